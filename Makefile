# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test bench slides release selftest clean

install: $(STAMP)

# Where this machine keeps a CPU build of torch on local disk, take it (--no-index: never
# fall back to downloading a multi-GB CUDA build). Elsewhere, pip resolves torch>=2.4 from
# pyproject; see README for the CUDA build on GPU lab machines.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-index "torch==2.13.0" 2>/dev/null \
	  || echo "no local CPU torch wheel: pip will resolve torch>=2.4 from pyproject"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name minidist --display-name "Python (minidist)" >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/minidist tour

test: $(STAMP)
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/minidist bench launch

slides: $(STAMP)
	$(BIN)/python slides/build.py

release: $(STAMP)
	$(BIN)/python -m autograder release

selftest: $(STAMP)
	$(BIN)/python -m autograder selftest

clean:
	rm -rf $(VENV) build .pytest_cache
