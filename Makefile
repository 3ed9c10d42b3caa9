# Both targets install what they need first; torch 2.13.0 goes first so that no
# dependency pulls a CUDA build.
PIP ?= python3 -m pip
export HF_DATASETS_OFFLINE=1
export HF_HUB_OFFLINE=1
export WANDB_MODE=disabled

.PHONY: install demo test

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'

demo: install
	bilinear-circuits demo

test: install
	python3 -m pytest -q
