# Two commands: `make demo` (run the bundled model) and `make test` (the test suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.clover-installed
TEST_STAMP := $(VENV)/.clover-test-installed

.PHONY: demo test test-slow install bench clean

TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

# `make demo` installs the package with the server (`clover serve`, the playground); `make test` adds
# the extras the tests exercise. torch: the CPU build, 2.13.0 where a local wheel has it, else the
# newest from PyTorch's CPU index (PyPI's Linux torch is the multi-GB CUDA build); pip shows progress.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install "torch==2.13.0+cpu" || $(BIN)/pip install torch --index-url $(TORCH_CPU_INDEX)
	$(BIN)/pip install -e ".[serve]"
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -e ".[serve,plot,test]"
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
