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
# Test processes (pytest-xdist; 0 = in this process). Many tests wait on workers they start or on timeouts, so
# three test processes keep two cores busier than two do (tests/conftest.py gives each its share of the cores).
PYTEST_WORKERS ?= 3
# The test order is shuffled on every run (pytest-randomly prints its seed): PYTEST_ARGS="-p randomly
# --randomly-seed=N" repeats an order, PYTEST_ARGS="-p no:randomly" keeps the files' own order.

.PHONY: install demo train test lint bench clean gpu-check

# The main job: the ZeRO-1 baseline against DeMo on an emulated slow link (2 workers as 2 nodes, 25 Mbit/s,
# 10 ms), the same 120 steps of the same micro-batches (equal tokens); ends with the comparison table and
# runs/demo/compare.png. `make train` is the plain single-strategy run.
DEMO_FLAGS ?= --strategies zero1 demo --model tiny --max-steps 120 --link inter=25mbit,10ms --eval-every 20 \
	--target-loss 5.3 --no-stop-at-target --no-progress

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(PIP) install -q $(FIND_LINKS) "$(TORCH_SPEC)"
	$(PIP) install -q $(FIND_LINKS) -e ".[train,accelerate,plan,dev,ft]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/quietsync compare $(DEMO_FLAGS) --out runs/demo --overwrite

train: install
	$(VENV)/bin/quietsync train --out runs/train --overwrite

# Bytecode is written (to the git-ignored __pycache__ folders) even where PYTHONDONTWRITEBYTECODE is set: the suite
# starts ~170 interpreters, and each would otherwise compile the same quietsync and test sources again.
test: install
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# Every GPU path on one CUDA device (≤ 8 min): writes runs/gpu-check/gpu-check.{md,json}, exits non-zero on a failure;
# refuses in one line without a CUDA device. Install the CUDA build of torch into the venv first (see above).
gpu-check: install
	$(VENV)/bin/python -m quietsync.gpu_check --out runs/gpu-check

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs
