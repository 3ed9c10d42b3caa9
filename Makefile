# Both targets install what they need first; torch 2.13.0 goes first so that no
# dependency pulls a CUDA build.
PIP ?= python3 -m pip
export HF_DATASETS_OFFLINE=1
export HF_HUB_OFFLINE=1
export WANDB_MODE=disabled

.PHONY: install demo test test-fast reference

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray,docs]' torch==2.13.0
	# circuit-tracer's viewer and graph schema (`graph`); it pins an older transformers, and its
	# front end needs only the standard library and pydantic, so none of its dependencies
	$(PIP) install -q --no-deps circuit-tracer==0.5.0
	# its viewer loads d3 with jetpack and dagre from the web; the browser test serves npm's builds
	# (and tests/circuit_tracer_viewer_shim.js for what npm's jetpack lacks) instead
	mkdir -p .cache/npm && for p in d3-jetpack@2.3.0 dagre@0.8.5; do test -f .cache/npm/$$(echo $$p | tr @ -).tgz || \
		npm pack --silent --pack-destination .cache/npm $$p >/dev/null || \
		echo "npm unavailable: the viewer's browser test will be skipped"; done

demo: install
	python3 -m pipelines demo

# everything, the end-to-end runs and the browser test (skipped without chromium) included
test: install
	python3 -m pytest -q

# for development: leaves out the end-to-end runs marked slow
test-fast:
	python3 -m pytest -q -m "not slow"

# Refresh the committed reference copy of the demo's tables and report (all but the
# interactions, lowrank_samples and gate_truth tables, the largest, which the demo regenerates).
reference: demo
	rm -rf results/reference
	mkdir -p results/reference
	cp -r results/demo/tables results/demo/report results/demo/demo_config.json results/reference/
	rm -rf results/reference/tables/.stamps results/reference/tables/interactions results/reference/tables/lowrank_samples \
		results/reference/tables/gate_truth
