# Set-up and the two project commands. Both create/reuse the venv in $(VENV); the CPU torch wheel is installed
# first so that pip never pulls a multi-GB CUDA build (override TORCH_SPEC on a GPU machine).
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/k3 info k3-full

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/kda.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
