# Two front-door targets: `make demo` (install + run the main job) and `make test` (install + run the tests).
# On a machine without /opt/wheels (or with a GPU), install torch your usual way first, e.g.
#   python3 -m venv .venv && .venv/bin/pip install torch   # CUDA build from PyPI
# and the targets below reuse it.
PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/pip
TORCH_SPEC ?= torch==2.13.0
WHEELS ?= /opt/wheels
FIND_LINKS := $(if $(wildcard $(WHEELS)),--find-links $(WHEELS),)
PYTEST_ARGS ?=

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(PIP) install -q $(FIND_LINKS) "$(TORCH_SPEC)"
	$(PIP) install -q $(FIND_LINKS) -e ".[train,accelerate,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/quietsync train --out runs/demo --overwrite

test: install
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs
