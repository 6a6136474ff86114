PYTHON ?= python3
# torch 2.13.0 first: its CPU wheel lies on this machine's disk, while a bare `torch` requirement would pull a
# multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test test-torch

install:
	$(PYTHON) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py

test: install
	$(PYTHON) -m pytest -q

# The suite on another torch release (make test-torch TORCH=2.15.0), in a venv of its own. Releases other than the
# one on disk come from PyPI as CUDA builds (about 5 GB; they run on the CPU); PIP_CONFIG_FILE=/dev/null lifts the
# machine's pip cap for these commands only.
TORCH ?= 2.15.0
TORCH_VENV = .venv-torch-$(TORCH)

test-torch:
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	PIP_CONFIG_FILE=/dev/null $(TORCH_VENV)/bin/python -m pip install -q "torch==$(TORCH)"
	PIP_CONFIG_FILE=/dev/null $(TORCH_VENV)/bin/python -m pip install -q -e ".[test]"
	$(TORCH_VENV)/bin/python -m pytest -q
