"""`make engine`'s gate: python scripts/smoke_engine.py LLAMA_SERVER MODEL.gguf exits 0 only when the binary loads
the model and answers a one-token request; otherwise one line saying how the server ended (e.g. killed by SIGILL)
and exit 1, so a binary that cannot run on this machine is never moved into place."""

import sys
from pathlib import Path

from phasekv.engines.llama_cpp import smoke
from phasekv.engines.process import EngineDied

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: smoke_engine.py LLAMA_SERVER MODEL.gguf")
    binary, model = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        token = smoke(binary, model)
    except EngineDied as e:
        sys.exit(f"smoke test failed: {e}")
    print(f"smoke test passed: {binary} loaded {model.name} and answered token {token}")
