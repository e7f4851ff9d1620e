# Two commands on a fresh machine: `make demo` and `make test` (`make test-gpu` on a GPU node). Each builds .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-e2e test-course test-gpu bench slides release student-dist selftest clean

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

# The suite: the library, the checks and the grader (under 15 minutes on 2 cores). The tests that
# grade (marker `serial`, tests/conftest.py) run last, one at a time: each keeps both cores busy
# itself. Every other test runs on two pytest workers first.
test: $(STAMP)
	@$(BIN)/python -m pytest -m "not course and not e2e and not serial" -n 2 $(PYTEST_ARGS); a=$$?; \
	$(BIN)/python -m pytest -m "serial and not course and not e2e" $(PYTEST_ARGS); b=$$?; \
	for rc in $$a $$b; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done; \
	if [ $$a -eq 5 ] && [ $$b -eq 5 ]; then echo "pytest collected no tests"; fi; exit 0

# The grader's long end-to-end runs on the fixture lab (marker `e2e`, about 9 minutes more): the cheat
# and attack banks, some 30 submissions that each try to buy a grade or break the batch, graded as one
# class with honest ones (each gains nothing); the Gradescope and PrairieLearn packages built,
# installed and run; a full selftest of a bank with uncaught bugs and failing alternatives; and an
# exercise added as docs/AUTHORING.md says. `make test` grades two of the attacks in its own batch.
test-e2e: $(STAMP)
	$(BIN)/python -m pytest -m e2e $(PYTEST_ARGS)

# The course's content end to end (marker `course`, about 16 minutes more): every lab's solution
# graded through nbgrader with the sandbox and the confirmation, every bug of its bank caught and
# every correct alternative full marks (its quick selftest), and every deck built from live runs.
# `.ci/run` runs it after `make test` and `make test-e2e`.
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

# What students get (autograder/handout/student_dist.py): the released labs, a wheel of minidist without the
# hidden cases, a README. Hand out $(STUDENT_DIST); the repository itself is the instructor's.
STUDENT_DIST ?= dist/student
student-dist: $(STAMP)
	$(BIN)/python -m autograder student-dist $(STUDENT_DIST)

selftest: $(STAMP)
	$(BIN)/python -m autograder selftest

clean:
	rm -rf $(VENV) build .pytest_cache
