# Two set-up commands: `make demo` and `make test`. Both create or reuse .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TINY := .tiny
export OMP_NUM_THREADS ?= 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: demo test test-unit test-dist test-e2e lint test-slow test-all bench serve clean chromium

# compileall: the project's own bytecode. An editable install leaves it to the first import, and
# where PYTHONDONTWRITEBYTECODE is set every process (each rank of each run) would compile it anew.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]' -c .ci/constraints.txt
	$(BIN)/python -m compileall -q neuron_parallel tasks flows
	touch $(STAMP)

$(TINY)/model/config.json: | $(STAMP)
	$(BIN)/neuron-flows make-tiny $(TINY)

demo: $(STAMP) $(TINY)/model/config.json
	$(BIN)/neuron-flows run configs/tiny-llama-cpu.yaml

# The browser test drives Debian's chromium; installed here when missing (needs root or sudo).
chromium:
	@command -v chromium >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# Lint and format are part of the test: CI runs `make test`.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest workers (pytest-xdist), a test file each at a time: a test spends much of its time
# waiting (for Prefect's polling, a server's start, a timeout under test), and one process alone
# kept about 1.2 of 2 cores busy. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: lint chromium
	$(BIN)/python -m pytest -q $(XDIST) --durations=40

# The tiers alone: unit (no processes, about a minute), dist (torchrun), e2e (Prefect, browser).
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

test-dist: $(STAMP)
	$(BIN)/python -m pytest -q tests/dist

test-e2e: $(STAMP) chromium
	$(BIN)/python -m pytest -q tests/e2e

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(XDIST) --durations=20

# Both tiers in one pytest session (what CI runs): the session's servers, warm ranks and tiny
# world start once, and the two workers share out every test file together.
test-all: lint chromium
	$(BIN)/python -m pytest -q -m "slow or not slow" $(XDIST) --durations=40

serve: $(STAMP) $(TINY)/model/config.json
	$(BIN)/neuron-flows serve

# Every benchmark that runs on CPU (bench/gpu.sh needs a GPU). BENCH_ARGS goes to each one:
# `make bench BENCH_ARGS=--quick` runs them all at small sizes, to see that they start and finish.
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	$(BIN)/python bench/train_throughput.py $(BENCH_ARGS)
	$(BIN)/python bench/checkpoint_save.py $(BENCH_ARGS)
	$(BIN)/python bench/consolidate.py $(BENCH_ARGS)
	$(BIN)/python bench/tokenization.py $(BENCH_ARGS)
	$(BIN)/python bench/comm.py $(BENCH_ARGS)
	$(BIN)/python bench/flow_overhead.py $(BENCH_ARGS)
	$(BIN)/python bench/planner.py $(BENCH_ARGS)

clean:
	rm -rf $(TINY) .runs
