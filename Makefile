# Two set-up commands: `make demo` and `make test`. Both create or reuse .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TINY := .tiny
export OMP_NUM_THREADS ?= 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: demo test test-slow bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

$(TINY)/model/config.json: | $(STAMP)
	$(BIN)/neuron-flows make-tiny $(TINY)

demo: $(STAMP) $(TINY)/model/config.json
	$(BIN)/neuron-flows run configs/tiny-llama-cpu.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,bench]'
	$(BIN)/python bench/train_throughput.py
	$(BIN)/python bench/checkpoint_save.py
	$(BIN)/python bench/consolidate.py

clean:
	rm -rf $(TINY) .runs
