PYTHON ?= python3
# torch 2.13.0 first: its CPU wheel lies on this machine's disk, while a bare `torch` requirement would pull a
# multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0

.PHONY: install demo test

install:
	$(PYTHON) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py

test: install
	$(PYTHON) -m pytest -q
