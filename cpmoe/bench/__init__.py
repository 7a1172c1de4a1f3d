"""Benchmarks: `cpmoe bench` (run.py; spec, model_task, hf_task, report, pooled, timing) and
the code of the bench/ scripts (attention_cp.py, dispatch.py)."""
