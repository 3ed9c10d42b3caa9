# Both targets install what they need first; torch 2.13.0 goes first so that no
# dependency pulls a CUDA build.
PIP ?= python3 -m pip
export HF_DATASETS_OFFLINE=1
export HF_HUB_OFFLINE=1
export WANDB_MODE=disabled

.PHONY: install demo test reference

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'

demo: install
	python3 -m pipelines demo

test: install
	python3 -m pytest -q

# Refresh the committed reference copy of the demo's tables and report (all but the
# 3 MB interactions table, which the demo regenerates).
reference: demo
	rm -rf results/reference
	mkdir -p results/reference
	cp -r results/demo/tables results/demo/report results/demo/demo_config.json results/reference/
	rm -rf results/reference/tables/_stages results/reference/tables/interactions
