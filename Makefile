# The README's two commands. Each creates .venv on first use and installs what it needs:
# torch 2.13.0 (CPU build on the CI machines), Triton 3.6.0 (the GPU machines' version; on CPU
# its interpreter runs the kernels in tests), numpy, pytest, megatron-core 0.16.1 (the newest
# with a Python 3.11 wheel), matplotlib (the demo's plot) and this package (editable).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0 numpy pytest megatron-core==0.16.1 matplotlib psutil
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.demo

test: $(STAMP)
	$(PY) -m pytest tests -q
