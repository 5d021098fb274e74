# `make run`: install into .venv, then serve the CPU demo pipeline in the foreground.
# `make test`: install into .venv (with test extras), then run the whole test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/cpu_omni_demo.yaml
PORT ?= 8000
ADMIN_PORT ?= 1900

.PHONY: install run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/python -m omni_actors.system start --convention-leader --config $(CONFIG) \
		--port $(PORT) --admin-port $(ADMIN_PORT)

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
