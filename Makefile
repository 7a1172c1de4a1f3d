# Two entry points for a fresh machine (CPU is enough):
#   make demo   set up .venv, then run the main job on the built-in tiny model
#   make test   set up .venv, then run the whole test suite
#   make test-newest-transformers   the HF-parity tests against the newest transformers
#                                   release, in a venv of its own (.venv-newest)
# TORCH_SPEC pins torch so pip never pulls a multi-GB CUDA build on a CPU machine.
# TRANSFORMERS_SPEC pins transformers: the tests' checkpoints are written by it (its random
# init draws the weights) and compared against its models, so a new release must not change
# what `make test` checks without a commit; it is installed after the project so it wins.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TRANSFORMERS_SPEC ?= transformers==5.24.0
PY := $(VENV)/bin/python
NEWEST_VENV := .venv-newest
# the tests that compare against HF transformers' own models
HF_PARITY_TESTS := tests/e2e/test_hf_parity.py tests/e2e/test_fp8_checkpoints.py \
	tests/e2e/test_deepseek_v4.py tests/e2e/test_deepseek_v4_fp8.py \
	tests/distributed/test_deepseek_v4_cp.py
DEMO_LAYOUT := --tp-size 4 --attn-cp-size 2 --moe-dp-size 1 --ep-size 4

.PHONY: setup demo test test-newest-transformers clean

$(VENV)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q "$(TRANSFORMERS_SPEC)"
	touch $@

setup: $(VENV)/.ready

demo: setup
	$(VENV)/bin/cpmoe plan $(DEMO_LAYOUT) --device cpu
	$(VENV)/bin/cpmoe generate $(DEMO_LAYOUT) --device cpu --prompt "Context parallel prefill" --max-new-tokens 16
	$(VENV)/bin/cpmoe check $(DEMO_LAYOUT) --device cpu --prompts 8 --lengths 33,300,1025

test: setup
	$(PY) -m pytest --durations=15

# the same install with transformers upgraded to its newest release, then the HF-parity tests
test-newest-transformers:
	$(MAKE) setup VENV=$(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install -q --upgrade transformers
	$(NEWEST_VENV)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(NEWEST_VENV)/bin/python -m pytest -p no:cacheprovider $(HF_PARITY_TESTS)

clean:
	rm -rf $(VENV) $(NEWEST_VENV)
