"""SGLang as an engine phasekv starts itself (`phasekv.engines.sglang`): its flags and checks, and a whole grid run
against a stand-in SGLang server (tests/fake_sglang_server.py: SGLang's /generate, /get_model_info and /server_info
around an induction rule, with a planted chunked-prefill bug) started the way the real one is, since no CPU build of
SGLang exists."""

import json
import stat
import sys
from pathlib import Path

import pytest

from phasekv.auditing.engine_grid import EngineGrid, grid_sets, run_grid
from phasekv.config import audit_config
from phasekv.engines.base import parse_grid
from phasekv.engines.registry import api, launcher
from tests.helpers import bpe_tokenizer
from tests.test_engine_grid import CFG, Induction

ROOT = Path(__file__).resolve().parents[1]
SGLANG = launcher("sglang")


def fake_sglang(where: Path, vocab: int) -> tuple[Path, Path]:
    """(an executable standing in for SGLang's Python, the model folder it serves)."""
    python = where / "python"
    python.write_text(f"#!/bin/sh\ncd {ROOT / 'tests'}\nexec {sys.executable} fake_sglang_server.py \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    model = where / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return python, model


def test_sglang_settings_map_to_its_flags_and_its_radix_cache_is_off_unless_asked():
    command = SGLANG.command(Path("py"), Path("m"), 9, {"chunked_prefill_size": "64"}, context=4096, slots=2)
    assert command[command.index("-m") + 1] == "sglang.launch_server"
    assert command[command.index("--context-length") + 1] == "2048"  # per sequence
    assert command[command.index("--chunked-prefill-size") + 1] == "64"
    assert "--disable-radix-cache" in command and "OMP_NUM_THREADS=1" in command
    on = SGLANG.command(Path("py"), Path("m"), 9, {"radix_cache": "on"}, context=4096, slots=1)
    assert "--disable-radix-cache" not in on
    assert SGLANG.caches_prefix({"radix_cache": "on"}) and not SGLANG.caches_prefix({})
    assert SGLANG.api == "sglang" and api("sglang").path == "/generate" and SGLANG.serves == "folder"


@pytest.mark.parametrize("items, message", [
    (["chunked_prefill_size=0"], "must be an integer >= 1"),
    (["kv_cache_dtype=int4"], "must be one of auto, fp8_e5m2, fp8_e4m3"),
    (["ubatch=16"], "SGLang's prefill chunk is chunked_prefill_size"),
    (["radix_cache=maybe"], "must be one of off, on"),
])
def test_bad_sglang_grid_values_are_one_line_refusals(items, message):
    with pytest.raises(ValueError, match=message):
        parse_grid(SGLANG, items)


def test_a_launched_sglang_grid_finds_its_planted_chunked_prefill_bug_and_records_its_server_args(tmp_path):
    tokenizer = bpe_tokenizer()
    python, model = fake_sglang(tmp_path, len(tokenizer))
    cfg = audit_config(**CFG)
    sets = grid_sets(tokenizer, cfg, ("query",), 8)
    length = sets["query"].prompt_length
    points = parse_grid(SGLANG, [f"chunked_prefill_size={length // 2},{4 * length}"])
    grid = EngineGrid(SGLANG, python, model, tuple(points), context=2048, startup_s=60)
    summary = run_grid(grid, tokenizer, cfg, tmp_path / "out", protocols=("query",), per_phase=8,
                       reference=Induction(len(tokenizer)), progress=False)
    small, large = summary["points"]
    bad = {g["query_phase"]: g["agreement"] for g in small["comparison"]["query"]["per_query_phase"]}
    assert bad[2] == 0 and all(bad[q] == 1 for q in bad if q != 2)  # length 3 mod 4 ends at query phase 2
    assert large["comparison"]["query"]["overall"]["agreement"] == 1
    args = small["engine_report"]["server_args"]
    assert args["chunked_prefill_size"] == length // 2 and args["disable_radix_cache"] is True
    assert args["context_length"] == 2048
