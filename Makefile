# Two commands: `make demo` (run the bundled model) and `make test` (the test suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.clover-installed
TEST_STAMP := $(VENV)/.clover-test-installed

.PHONY: demo test test-slow install bench clean

# `make demo` needs the package alone; `make test` adds the extras the tests exercise.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.5"
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[serve,plot,test]"
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/clover demo

# two workers, one per core (each test runs torch at 1 thread: tests/conftest.py); a file stays on one worker
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

test-slow: $(TEST_STAMP)
	CLOVER_SLOW=1 $(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/clover bench kernels --only gdn

clean:
	rm -rf $(VENV) build .pytest_cache
