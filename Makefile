# ringmoe: `make demo` runs the main job, `make test` runs the test suite (`make test-all` adds the slow cases).
# Both create .venv and install everything on first use (a fresh machine needs only Python, pip, gcc).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUNTIME := $(VENV)/.runtime-installed
STAMP  := $(VENV)/.installed

.PHONY: test test-all demo bench install clean

# what the demo needs (the library, its server, the openai client): a fresh `make demo` installs only this
$(RUNTIME): pyproject.toml requirements/runtime.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements/runtime.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(RUNTIME)

# everything the tests and benchmarks use besides
$(STAMP): $(RUNTIME) requirements/dev.txt
	$(BIN)/python -m pip install -q -r requirements/dev.txt
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(RUNTIME)
	$(BIN)/ringmoe demo

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_attention.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
