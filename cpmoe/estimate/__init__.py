"""Layout cost model behind `cpmoe plan --estimate`: which layout for this model, this prompt
length, these GPUs.

    rates.py      measured rates (FLOP/s, bytes/s, seconds) of one GPU and its link; the H200
                  defaults and the calibration file (load / save)
    cost.py       the cost terms of one layer and one step, per rank, for a layout
    enumerate.py  every layout of N GPUs that `cpmoe plan` accepts for a model
    report.py     estimates of those layouts, ranked, as text or JSON
    calibrate.py  `cpmoe bench-calibrate`: the rates measured on one CUDA GPU
    validate.py   predictions against every recorded prefill in bench/results

Pure Python on top of the layout and the model config: nothing here needs a GPU except the
calibration's measurement.
"""
