# Two entry points for a fresh machine (CPU is enough):
#   make demo   set up .venv, then run the main job on the built-in tiny model
#   make test   set up .venv, then run the whole test suite
# TORCH_SPEC pins torch so pip never pulls a multi-GB CUDA build on a CPU machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
DEMO_LAYOUT := --tp-size 4 --attn-cp-size 2 --moe-dp-size 1 --ep-size 4

.PHONY: setup demo test clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.ready

demo: setup
	$(VENV)/bin/cpmoe plan $(DEMO_LAYOUT) --device cpu
	$(VENV)/bin/cpmoe generate $(DEMO_LAYOUT) --device cpu --prompt "Context parallel prefill" --max-new-tokens 16
	$(VENV)/bin/cpmoe check $(DEMO_LAYOUT) --device cpu --prompts 8 --lengths 33,300,1025

test: setup
	$(PY) -m pytest --durations=15

clean:
	rm -rf $(VENV)
