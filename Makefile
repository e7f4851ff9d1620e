# Two commands on a fresh machine: `make demo` and `make test` (`make test-gpu` on a GPU node). Each builds .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-course test-gpu bench slides release student-dist selftest clean

install: $(STAMP)

# A CPU build of torch that this machine keeps on local disk (pip's find-links folders).
# Installing it first means `torch>=2.4` in pyproject is already met, so pip never pulls a
# multi-GB CUDA build onto a CPU machine. Without one, pip resolves torch itself: on a GPU
# lab machine that is the CUDA build you want (README: CPU-only machines elsewhere).
WHEEL_DIRS := $(subst file://,,$(PIP_FIND_LINKS)) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null) /opt/wheels
TORCH_CPU_WHEEL := $(firstword $(wildcard $(addsuffix /torch-*+cpu-*.whl,$(WHEEL_DIRS))))

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_CPU_WHEEL),$(BIN)/python -m pip install --quiet "$(TORCH_CPU_WHEEL)",@echo "no local CPU torch wheel: pip resolves torch>=2.4 from pyproject")
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name minidist --display-name "Python (minidist)" >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/minidist tour

# The suite: the library, the checks and the grader (under 15 minutes on 2 cores).
test: $(STAMP)
	@$(BIN)/python -m pytest -m "not course" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

# The course's content end to end (marker `course`, about 13 minutes more): every lab's solution
# graded through nbgrader with the sandbox and the confirmation, every bug of its bank caught and
# every correct alternative full marks (its quick selftest), and every deck built from live runs.
# `.ci/run` runs it after `make test`.
test-course: $(STAMP)
	$(BIN)/python -m pytest -m course $(PYTEST_ARGS)

# The GPU suite alone (tests/test_gpu.py): one level needs 1 GPU, the other 4; on a machine
# with fewer, each test is skipped with its reason. `make test` runs (or skips) them too.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu -rs $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/minidist bench launch

slides: $(STAMP)
	$(BIN)/python slides/build.py --check

release: $(STAMP)
	$(BIN)/python -m autograder release

# What students get (autograder/student_dist.py): the released labs, a wheel of minidist without the
# hidden cases, a README. Hand out $(STUDENT_DIST); the repository itself is the instructor's.
STUDENT_DIST ?= dist/student
student-dist: $(STAMP)
	$(BIN)/python -m autograder student-dist $(STUDENT_DIST)

selftest: $(STAMP)
	$(BIN)/python -m autograder selftest

clean:
	rm -rf $(VENV) build .pytest_cache
