"""The cost of one engine-grid point (phasekv starts llama-server, audits, stops it, publishes the point) as a ratio
to the audit alone against a server that is already up, measured in one run.

The model is checkpoints/dsv4-csa exported as GGUF (`phasekv export gguf`, into a temporary directory), served by
the real llama-server (`make engine`) with one thread; the prompts are the query protocol's set of its training
records (32 records, 8 demonstrations, stride 4, `--prompts-per-phase` prompts per phase), no reference (the
reference is computed once per grid, not per point).  Modes, alternating, best of --repeats:

    point   `run_grid` with one point: server start, health wait, the audit, the server stopped, OUT published
    audit   the same prompts through a fresh adapter to a server started before the clock (`measure`)
    start   the server's start alone: `started` until /health answers

Last line: `point_s=X audit_s=Y start_s=Z ratio_point_to_audit=R`.

    .venv/bin/python benchmarks/engine_grid.py [--prompts-per-phase 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.engine: where make engine installs the binary

from tests.engine import LLAMA_SERVER  # noqa: E402

from phasekv.adapters.hf import load_tokenizer  # noqa: E402
from phasekv.auditing import engine_grid  # noqa: E402
from phasekv.config import audit_config  # noqa: E402
from phasekv.engines.client import EndpointAdapter  # noqa: E402
from phasekv.engines.registry import launcher, started  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-per-phase", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if not LLAMA_SERVER.is_file():
        sys.exit(f"engine_grid: needs {LLAMA_SERVER} (make engine)")
    from phasekv.cli import main as phasekv

    llama = launcher("llama-server")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        assert phasekv(["export", "gguf", "--checkpoint", str(ROOT / "checkpoints" / "dsv4-csa"), "--out",
                        str(tmp / "m.gguf"), "--hf-out", str(tmp / "hf")]) == 0
        tokenizer = load_tokenizer(str(tmp / "hf"), None)
        cfg = audit_config(format="none", records=32, demos=8, local_window=16, stride=4)
        grid = engine_grid.EngineGrid(llama, LLAMA_SERVER, tmp / "m.gguf", ({},), context=512)
        sets = engine_grid.grid_sets(tokenizer, cfg, ("query",), args.prompts_per_phase)
        best = {"point": float("inf"), "audit": float("inf"), "start": float("inf")}
        for r in range(args.repeats):
            began = time.perf_counter()
            engine_grid.run_grid(grid, tokenizer, cfg, tmp / f"grid{r}", protocols=("query",),
                                 per_phase=args.prompts_per_phase, progress=False)
            best["point"] = min(best["point"], time.perf_counter() - began)
            began = time.perf_counter()
            with started(llama, LLAMA_SERVER, tmp / "m.gguf", {}, context=512) as url:
                best["start"] = min(best["start"], time.perf_counter() - began)
                adapter = EndpointAdapter(url, "llamacpp", len(tokenizer))
                (tmp / f"audit{r}").mkdir()
                began = time.perf_counter()
                engine_grid.measure(adapter, sets, tmp / f"audit{r}", cfg=cfg, logprobs={}, reference=None,
                                     checks={}, progress=False)
                best["audit"] = min(best["audit"], time.perf_counter() - began)
                adapter.close()
    print(f"{sum(len(s.prompts()) for s in sets.values())} prompts, load {os.getloadavg()[0]:.1f}")
    print(f"point_s={best['point']:.2f} audit_s={best['audit']:.2f} start_s={best['start']:.2f} "
          f"ratio_point_to_audit={best['point'] / best['audit']:.2f}")


if __name__ == "__main__":
    main()
