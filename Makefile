# The README's two commands. Each creates .venv on first use and installs what it needs:
# torch 2.13.0 (CPU build on the CI machines), Triton 3.6.0 (the GPU machines' version; on CPU
# its interpreter runs the kernels in tests), numpy, pytest, megatron-core 0.16.1 (the newest
# with a Python 3.11 wheel), matplotlib (the demo's plot), psutil (Megatron's checkpoint writer), pytest-xdist (the
# tests in two processes) and this package (editable).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0 numpy pytest pytest-xdist megatron-core==0.16.1 matplotlib psutil
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.demo

# Two pytest workers of one torch thread each: on the 2-core CI machines the interpreter-bound tests leave a core
# idle when run one at a time (620 s serial, 402 s so; 2026-11-28), and two workers of torch's default two threads
# each oversubscribe the cores (516 s).
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -q -n 2
