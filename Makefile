# Every target that needs the environment depends on `install`, so a fresh clone just works.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-slow lint format clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[bench,notebooks,dev]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check fms_paged tests scripts

format: install
	$(PY) -m ruff format fms_paged tests scripts

clean:
	rm -rf $(VENV) build *.egg-info results .pytest_cache
