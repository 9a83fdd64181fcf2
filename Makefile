# Two entry points a newcomer needs; each creates .venv and installs what is missing.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: compare test lint
compare: $(STAMP)  ## the main job: static PD vs Crossflow on the bundled traces
	$(VENV)/bin/crossflow compare

test: $(STAMP)  ## lint (pinned ruff) and the test suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -n 2 -q

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/mypy policies envs interference_model serving train
