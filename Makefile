# `make test` and `make demo` create .venv on first use and reuse it afterwards.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PIP     := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: test demo lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PIP) torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
	@$(PIP) -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import phasekv, torch; assert torch.__version__.startswith('2.13.0')"
	@touch $(STAMP)

lint: $(STAMP)
	@$(VENV)/bin/ruff check src tests benchmarks

test: lint
	@$(VENV)/bin/pytest tests

demo: $(STAMP)
	@$(VENV)/bin/phasekv reproduce --out runs/demo --force

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
