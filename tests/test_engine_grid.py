"""The engine grid (`phasekv audit --launch`): the launcher registry's flags and checks, and whole grids run against
a stand-in llama-server (tests/fake_llama_server.py, an induction rule with a planted ubatch bug) started the way the
real one is: one server per point, nothing left running, a killed grid resumed without redoing finished points."""

import json
import stat
import sys
from pathlib import Path

import pytest
import torch

from phasekv.adapters.base import ModelInfo
from phasekv.auditing.engine_grid import EngineGrid, grid_sets, run_grid, verdict_class
from phasekv.config import audit_config
from phasekv.engines.base import parse_grid, point_name
from phasekv.engines.registry import launcher
from phasekv.outputs import MARKER, PARTIAL
from tests.fake_llama_server import induction
from tests.helpers import PromptAdapter, bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]
LLAMA = launcher("llama-server")


class Induction(PromptAdapter):
    """The reference of the stand-in server: the same induction rule, in process, without the planted bug."""

    def __init__(self, vocab_size: int):
        self.info = ModelInfo("induction", vocab_size, 0, 0, 0, 0, 1 << 20, None, None)

    def answer(self, prompt):
        return induction(prompt)

    def logits(self, ids):
        """Every position's next token (teacher forcing reads them all), not only the last one's."""
        out = torch.zeros(ids.shape[0], ids.shape[1], self.info.vocab_size)  # (B, T, V)
        for b, row in enumerate(ids.tolist()):
            for t in range(len(row)):
                out[b, t, induction(row[:t + 1])] = 1.0
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def fake_engine(where: Path, vocab: int) -> tuple[Path, Path]:
    """(an executable that runs the stand-in server, its model file)."""
    binary = where / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'fake_llama_server.py'} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    model = where / "model.json"
    model.write_text(json.dumps({"n_vocab": vocab}))
    return binary, model


CFG = dict(records=16, demos=2, stride=4, local_window=8)


def test_grid_flags_map_to_llama_server_flags_and_every_combination_is_a_point():
    points = parse_grid(LLAMA, ["ubatch=16,512", "flash_attn=on,off", "cache_type_k=q8_0"])
    assert [point_name(p) for p in points] == [
        "ubatch=16,flash_attn=on,cache_type_k=q8_0", "ubatch=16,flash_attn=off,cache_type_k=q8_0",
        "ubatch=512,flash_attn=on,cache_type_k=q8_0", "ubatch=512,flash_attn=off,cache_type_k=q8_0"]
    command = LLAMA.command(Path("/bin/llama-server"), Path("m.gguf"), 9, points[0], context=512, slots=2)
    assert command[:9] == ["/bin/llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "9", "-c", "512"]
    flags = command[command.index("--no-webui") + 1:]
    assert dict(zip(flags[::2], flags[1::2])) == {"-t": "1", "-ub": "16", "-fa": "on", "-ctk": "q8_0"}
    threads = LLAMA.command(Path("b"), Path("m"), 9, {"threads": "2"}, context=512, slots=1)
    assert threads.count("-t") == 1 and threads[threads.index("-t") + 1] == "2"
    assert parse_grid(LLAMA, []) == [{}] and point_name({}) == "default"
    both = LLAMA.command(Path("b"), Path("m"), 9, {"cache_type": "q8_0"}, context=512, slots=1)
    assert both[both.index("-ctk") + 1] == both[both.index("-ctv") + 1] == "q8_0"


def test_a_server_that_dies_is_reported_by_its_first_error_line_and_its_last_lines(tmp_path):
    from phasekv.engines.process import EngineDied, launched

    script = tmp_path / "dies"
    script.write_text("#!/bin/sh\necho 'I loading'\necho '0.05 E no K/V mix: the cause'\nfor i in 1 2 3 4; do echo \"I "
                      "line $i\"; done\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(EngineDied) as died, launched([str(script)], "http://127.0.0.1:9", name="dies", startup_s=30):
        pass
    assert str(died.value) == ("dies exited with status 1 before it served: 0.05 E no K/V mix: the cause | I line 2 | "
                               "I line 3 | I line 4")


@pytest.mark.parametrize("items, message", [
    (["ubatch=0"], "integer >= 1"), (["flash_attn=maybe"], "one of on, off, auto"), (["ubatch"], "KEY=V1,V2"),
    (["rope=1"], "not a llama-server setting"), (["ubatch=1", "ubatch=2"], "given twice"),
    (["cache_type_k=q8_0,q8_0"], "repeated"), (["cache_type_v=q9"], "one of"),
])
def test_bad_grid_values_are_one_line_refusals(items, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_grid(LLAMA, items)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown engine"):
        launcher("vllm-nope")


def test_verdict_class_drops_the_numbers():
    assert verdict_class("phase sensitive: period 4, gap 87.5 pp (accuracy 50%)") == "phase sensitive"
    assert verdict_class("cannot do the task (accuracy 1.0%, ...): no phase verdict") == "cannot do the task"
    assert verdict_class("no phase effect detected: gap 3 pp") == "no phase effect detected"


def _grid(tmp_path, tokenizer, points):
    binary, model = fake_engine(tmp_path, len(tokenizer))
    return EngineGrid(LLAMA, binary, model, tuple(points), context=2048, startup_s=60)


def ubatch_grid(tmp_path, tokenizer, per_phase, checks=None):
    """(the query prompt set, the summary of a grid of ubatch = half and four times its prompt length)."""
    cfg = audit_config(**CFG)
    sets = grid_sets(tokenizer, cfg, ("query",), per_phase)
    length = sets["query"].prompt_length
    grid = _grid(tmp_path, tokenizer, parse_grid(LLAMA, [f"ubatch={length // 2},{4 * length}"]))
    return sets, run_grid(grid, tokenizer, cfg, tmp_path / "out", protocols=("query",), per_phase=per_phase,
                          reference=Induction(len(tokenizer)), checks=checks, progress=False)


def test_a_ubatch_below_the_prompt_length_shows_the_planted_bug_and_only_there(tmp_path, tokenizer):
    sets, summary = ubatch_grid(tmp_path, tokenizer, 32)
    length = sets["query"].prompt_length
    small, large = summary["points"]
    assert small["settings"] == {"ubatch": str(length // 2)}
    bad = {g["query_phase"]: g["agreement"] for g in small["comparison"]["query"]["per_query_phase"]}
    broken = 2  # prompts of length 3 mod 4 end at a query position of 2 mod 4
    assert bad[broken] == 0 and all(bad[q] == 1 for q in bad if q != broken)
    assert small["protocols"]["query"]["query_phase"]["verdict"].startswith("phase sensitive: period 4")
    assert large["comparison"]["query"]["overall"]["agreement"] == 1
    assert large["protocols"]["query"]["query_phase"]["verdict"].startswith("no phase effect")
    out = tmp_path / "out"
    assert {p.name for p in (out / "points").iterdir()} == {small["name"], large["name"]}
    assert (out / "points" / small["name"] / "query" / "metrics.json").is_file()
    assert (out / "points" / small["name"] / "endpoint_journal.jsonl").is_file()
    props = small["engine_report"]["props"]
    assert props["total_slots"] == 1 and "chat_template" not in props
    assert small["engine_report"]["slots"][0]["n_ctx"] == 2048
    table = (out / "grid.md").read_text()
    assert "phase sensitive, period 4" in table and table.count("\n") == 4
    assert {p.name for p in (out / "figures").iterdir()} == {"accuracy_query.png", "agreement_phase_query.png",
                                                             "agreement_query_phase_query.png"}
    assert not (out / PARTIAL).exists() and [p.name for p in tmp_path.iterdir() if "out" in p.name] == ["out"]
    assert json.loads((out / "summary.json").read_text())["rows"] == summary["rows"]


def test_force_and_resume_never_delete_a_users_files(tmp_path, tokenizer):
    """The issue's case: a user's out.grid/mine/notes.txt beside OUT is never touched (the grid works inside OUT),
    and --force over an OUT a user added a file to is refused with the file kept."""
    cfg = audit_config(**CFG)
    grid = _grid(tmp_path, tokenizer, parse_grid(LLAMA, ["ubatch=8"]))
    out, mine = tmp_path / "out", tmp_path / "out.grid" / "mine" / "notes.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("keep")
    run_grid(grid, tokenizer, cfg, out, protocols=("prefix",), per_phase=2, progress=False)
    (out / "notes.txt").write_text("mine too")
    for flags in ({"force": True}, {"force": True, "resume": True}, {"resume": True}):
        with pytest.raises(ValueError, match="which phasekv did not write|exists and is not empty"):
            run_grid(grid, tokenizer, cfg, out, protocols=("prefix",), per_phase=2, progress=False, **flags)
    assert (out / "notes.txt").read_text() == "mine too" and (out / "summary.json").is_file()
    (out / "notes.txt").unlink()
    run_grid(grid, tokenizer, cfg, out, protocols=("prefix",), per_phase=2, progress=False, force=True, resume=True)
    assert mine.read_text() == "keep" and (out / "summary.json").is_file() and not (out / PARTIAL).exists()


def test_a_killed_grid_resumes_without_redoing_finished_points(tmp_path, tokenizer, monkeypatch):
    from phasekv.auditing import engine_grid

    cfg = audit_config(**CFG)
    grid = _grid(tmp_path, tokenizer, parse_grid(LLAMA, ["ubatch=8,4096", "flash_attn=on,off"]))
    calls = []
    real = engine_grid.measure

    def dies_at_the_third(adapter, *args, **kwargs):
        calls.append(adapter.conn.url)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(adapter, *args, **kwargs)

    monkeypatch.setattr(engine_grid, "measure", dies_at_the_third)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_grid(grid, tokenizer, cfg, out, protocols=("prefix",), per_phase=4, progress=False)
    assert len(list((out / PARTIAL).glob("*/point.json"))) == 2  # the grid's work lies inside OUT, nothing beside it
    assert {p.name for p in out.iterdir()} == {MARKER, PARTIAL}
    assert _servers_of(grid.binary) == []  # the server of the killed point was stopped
    with pytest.raises(ValueError, match="--resume"):
        run_grid(grid, tokenizer, cfg, out, protocols=("prefix",), per_phase=4, progress=False)
    calls.clear()
    summary = run_grid(grid, tokenizer, cfg, out, protocols=("prefix",), per_phase=4, resume=True, progress=False)
    assert len(calls) == 2 and len(summary["points"]) == 4 and all("failed" not in p for p in summary["points"])


def test_a_server_that_does_not_come_up_is_a_row_with_its_reason(tmp_path, tokenizer):
    cfg = audit_config(**CFG)
    grid = _grid(tmp_path, tokenizer, [{"ubatch": "8"}])
    (tmp_path / "model.json").write_text("not json")
    summary = run_grid(grid, tokenizer, cfg, tmp_path / "out", protocols=("prefix",), per_phase=4, progress=False)
    (row,) = summary["rows"]
    assert "exited with status 1 before it served" in row["failed"] and "\n" not in row["failed"]
    assert "failed: " in (tmp_path / "out" / "grid.md").read_text()


def _servers_of(binary: Path) -> list[int]:
    """Processes still running the stand-in server of `binary`'s directory."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(str(binary.parent / "model.json").encode() == part for part in cmdline):
                found.append(int(proc.name))
    return found


def test_the_audit_command_runs_a_grid_and_refuses_bad_flags_in_one_line(tmp_path, tokenizer, capsys):
    from phasekv.cli import main

    binary, model = fake_engine(tmp_path, len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "tok")
    base = ["audit", "--launch", "llama-server", "--engine-bin", str(binary), "--engine-model", str(model),
            "--tokenizer", str(tmp_path / "tok"), "--records", "16", "--demos", "2", "--stride", "4",
            "--local-window", "8", "--prompts-per-phase", "4", "--protocol", "prefix", "--no-progress"]
    assert main([*base, "--engine-grid", "ubatch=8", "--out", str(tmp_path / "o")]) == 0
    assert "ubatch=8" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["grid"] == [{"ubatch": "8"}]
    for flags, message in ((["--engine-grid", "ubatch=x"], "integer"),
                           (["--engine-bin", str(tmp_path / "none")], "no such file"),
                           (["--engine-grid", "ubatch=8", "--timeout", "0"], "finite number of seconds > 0")):
        assert main([*base, *flags, "--out", str(tmp_path / "p")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and not (tmp_path / "p").exists()


def test_an_audit_of_a_server_the_user_started_records_its_settings(tmp_path, tokenizer):
    from phasekv.auditing.pipeline import run_audit
    from phasekv.config import AuditPlan
    from phasekv.engines.client import EndpointAdapter
    from phasekv.engines.registry import started

    binary, model = fake_engine(tmp_path, len(tokenizer))
    with started(LLAMA, binary, model, {"ubatch": "64"}, context=1024) as url:
        adapter = EndpointAdapter(url, "llamacpp", len(tokenizer))
        summary = run_audit(adapter, tokenizer, audit_config(**CFG), tmp_path / "a", progress=False,
                            plan=AuditPlan(("none",), protocols=("prefix",), prompts_per_phase=2))
        adapter.close()
    report = json.loads((tmp_path / "a" / "summary.json").read_text())["engine_report"]
    assert report == summary["engine_report"] and report["props"]["model_path"] == str(model)
    assert report["props"]["default_generation_settings"]["n_ctx"] == 1024 and report["slots"][0]["id"] == 0


def test_decode_steps_find_the_planted_bug_at_its_position_mod_4_and_only_below_the_prompt_length(tmp_path, tokenizer):
    from phasekv.auditing.decode import decode_check

    sets, summary = ubatch_grid(tmp_path, tokenizer, 4, {"decode": decode_check(5)})
    small, large = (p["decode"] for p in summary["points"])
    # a step is predicted at position p = length - 1 + j; the bug hits inputs of length 3 mod 4: p = 2 mod 4
    assert {g["phase"]: g["agreement"] for g in small["per_phase"]} == {0: 1, 1: 1, 2: 0, 3: 1}
    assert [g["phase"] for g in small["first_disagreement"]["per_phase"]] == [2]
    assert small["first_disagreement"]["prompts"] == small["n_prompts"] and small["tokens_generated"] == 5 * small[
        "n_prompts"]
    assert all(c["agreement"] == (0 if c["phase"] == 2 else 1) for c in small["cells"])
    assert large["overall"]["agreement"] == 1 and large["first_disagreement"]["prompts"] == 0
    value_tokens = sets["query"].settings["value_tokens"]
    assert [s["engine_accuracy"] for s in large["per_step"]] == [1.0] * value_tokens + [None] * (5 - value_tokens)
    assert "decode_agreement" in summary["rows"][0] and (tmp_path / "out" / "figures" / "decode.png").is_file()


def test_prefix_cache_and_batch_paths_find_their_planted_bugs_per_residue(tmp_path, tokenizer):
    from phasekv.auditing.engine_paths import cached_length, paths_check

    assert [cached_length(20, r, 4) for r in range(4)] == [16, 17, 18, 15]
    cfg = audit_config(**CFG)
    grid = _grid(tmp_path, tokenizer, parse_grid(LLAMA, ["ubatch=4096", "flash_attn=on,off", "cache_type_k=f16,q8_0"]))
    grid = EngineGrid(grid.engine, grid.binary, grid.model, grid.points, context=2048 * 4, slots=4, startup_s=60)
    summary = run_grid(grid, tokenizer, cfg, tmp_path / "out", protocols=("query",), per_phase=4, progress=False,
                       checks={"prefix": paths_check("prefix"), "batch": paths_check("batch", 4)})
    for p in summary["points"]:
        prefix = {g["residue"]: g["agreement"] for g in p["prefix"]["per_residue"]}
        assert prefix == {r: 0 if (r == 1 and p["settings"]["flash_attn"] == "off") else 1 for r in range(4)}
        assert p["prefix"]["cache_served_prefix"] == 1
        batch = {g["query_phase"]: g["agreement"] for g in p["batch"]["per_query_phase"]}
        # length 0 mod 4 = query position 3 mod 4
        assert batch == {q: 0 if (q == 3 and p["settings"]["cache_type_k"] == "q8_0") else 1 for q in range(4)}
        assert p["batch"]["distinct_lengths_per_batch"] > 1
