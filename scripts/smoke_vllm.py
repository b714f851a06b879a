"""`make vllm`'s gate: python scripts/smoke_vllm.py VLLM_PYTHON MODEL_DIR CACHE_ROOT exits 0 only when vLLM (run by
its own environment's Python) serves the safetensors folder and answers a one-token request with a token id;
otherwise one line saying how the server ended and exit 1, so a broken install is never moved into place."""

import sys
from pathlib import Path

from phasekv.engines.process import EngineDied
from phasekv.engines.vllm import smoke_vllm

if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: smoke_vllm.py VLLM_PYTHON MODEL_DIR CACHE_ROOT")
    python, model, cache_root = (Path(a) for a in sys.argv[1:])
    try:
        token = smoke_vllm(python, model, cache_root)
    except EngineDied as e:
        sys.exit(f"smoke test failed: {e}")
    print(f"smoke test passed: vLLM served {model.name} and answered token {token}")
