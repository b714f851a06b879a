"""The write-path rule (`phasekv.outputs`, `phasekv.cli.check_inputs_untouched`): a command writes its --out and
nothing beside it, keeps a killed run's work inside --out (OUT/.partial), never writes over or deletes a path it was
given as input, and `--force` / `--resume` replace only what phasekv wrote (a user's file survives).  Per command
family: the parent of --out listed before and after a run, the inputs' bytes hashed before and after."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from phasekv.cli import main
from phasekv.engines.journal import Journal
from phasekv.engines.wire import EndpointError
from phasekv.outputs import (
    MARKER,
    PARTIAL,
    check_output_dir,
    drop_partial,
    output_dir,
    partial_dir,
    write_json,
)
from tests.helpers import bpe_tokenizer, tiny_causal_lm
from tests.test_evaluate import VOCAB, _tiny_hf
from tests.test_train import TINY

RUN = {**TINY, "train": {**TINY["train"], "steps": 2, "eval_every": 2, "checkpoint_every": 2, "eval_sequences": 8},
       "eval": {"stride": 4, "clusters": 2, "records": 32, "demos": 2}}


def digest(root: Path) -> dict[str, str]:
    """Every file under `root` (or `root` itself) -> a hash of its bytes."""
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def one_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    import yaml

    from phasekv.config import Experiment
    from phasekv.training.loop import train

    root = tmp_path_factory.mktemp("writes")
    (root / "tiny.yaml").write_text(yaml.safe_dump(RUN))
    train(Experiment.from_file(root / "tiny.yaml"), root / "run", progress=False)
    _tiny_hf(root, VOCAB.words)
    tokenizer = bpe_tokenizer()  # a tokenizer the audit's prompt formats need
    tiny_causal_lm("llama", len(tokenizer), 1024, "sdpa").save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root


# ----------------------------------------------------------------------------- outputs: the rule itself


def test_force_replaces_only_what_phasekv_wrote(tmp_path):
    out = tmp_path / "out"
    with output_dir(out) as tmp:
        write_json(tmp / "a.json", {"a": 1})
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("b")
    assert (out / MARKER).read_text().splitlines()[-2:] == ["a.json", "sub/b.txt"]
    (out / "mine").mkdir()
    (out / "mine" / "notes.txt").write_text("a user's notes")
    kept = digest(out)
    with pytest.raises(ValueError, match=r"holds mine/notes.txt, which phasekv did not write"), \
            output_dir(out, force=True) as tmp:
        write_json(tmp / "a.json", {"a": 2})
    assert digest(out) == kept and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (out / "mine" / "notes.txt").unlink()
    (out / "mine").rmdir()
    with output_dir(out, force=True) as tmp:  # phasekv's own files only: replaced
        write_json(tmp / "a.json", {"a": 2})
    assert json.loads((out / "a.json").read_text()) == {"a": 2} and not (out / "sub").exists()


def test_a_folder_phasekv_did_not_write_is_never_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    for force in (False, True):
        with pytest.raises(ValueError, match="not a phasekv output" if force else "pass --force"):
            check_output_dir(out, force, resume=True)
    assert (out / "notes.txt").read_text() == "x"


def test_a_runs_work_lies_inside_out_and_is_continued_only_with_resume_or_force(tmp_path):
    out = tmp_path / "out"
    work = partial_dir(out, force=False, resume=False)
    assert work == out / PARTIAL and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (work / "journal.jsonl").write_text("answers so far\n")
    with pytest.raises(ValueError, match="interrupted run .* pass --resume to continue it or --force"):
        check_output_dir(out, False)
    with pytest.raises(ValueError, match="pass --resume"):
        partial_dir(out, force=False, resume=False)
    assert partial_dir(out, force=False, resume=True) == work and (work / "journal.jsonl").is_file()
    with output_dir(out, False, resume=True) as tmp:
        write_json(tmp / "summary.json", {})
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "summary.json"]  # the publish replaced the work
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    partial_dir(out, force=False, resume=True)
    assert (out / "summary.json").is_file()  # a rerun's work beside an old result leaves the result as it was


def test_a_refused_run_leaves_no_out_behind(tmp_path):
    out = tmp_path / "deep" / "out"
    partial_dir(out, force=False, resume=False)
    drop_partial(out)
    assert not out.exists()
    given = tmp_path / "given"
    given.mkdir()  # an empty --out the user made is kept
    partial_dir(given, force=False, resume=False)
    drop_partial(given)
    assert given.is_dir()


def test_out_dot_is_the_current_directory_and_nothing_is_written_beside_it(tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    partial_dir(".", force=False, resume=False)
    with output_dir(".", resume=True) as tmp:
        write_json(tmp / "summary.json", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]
    assert sorted(p.name for p in here.iterdir()) == [MARKER, "summary.json"]
    with pytest.raises(ValueError, match="root directory"):
        check_output_dir("/", True)


# ----------------------------------------------------------------------------- journals are never rewritten


@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary \x89PNG\r\n\x1a\n\x00", b"",
                                     b'{"journal": 1, "api": "openai"}\n{"key": "a", "tok'])
def test_a_foreign_binary_or_torn_journal_is_refused_and_left_as_it_was(tmp_path, content):
    path = tmp_path / "out" / PARTIAL / "endpoint_journal.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(EndpointError, match="not a phasekv endpoint journal|other settings"):
        Journal(path, {"api": "llamacpp"}, resume=True)
    assert path.read_bytes() == content


def test_a_torn_journal_is_cut_only_when_the_run_continues_it(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"journal": 1, "api": "x"}\n{"key": "a", "tok')
    journal = Journal(path, {"api": "x"}, resume=True)
    assert path.read_bytes().endswith(b'"tok')  # read, not yet rewritten
    journal.bind("prompt_set", "p")
    assert path.read_text().splitlines() == ['{"journal": 1, "api": "x"}', '{"bound":{"prompt_set":"p"}}']


# ----------------------------------------------------------------------------- inputs are never written


def test_write_expect_over_the_served_model_or_its_tokenizer_is_refused(tmp_path, capsys):
    tok = _tiny_hf(tmp_path, VOCAB.words)
    (tok / "m.gguf").write_bytes(b"GGUF served weights")
    model = tmp_path / "served.gguf"
    model.write_bytes(b"GGUF other weights")
    os.link(model, tmp_path / "alias.gguf")
    before = {**digest(tok), **digest(model)}
    capsys.readouterr()
    cases = [(["--endpoint", "http://127.0.0.1:1", "--tokenizer", str(tok), "--gguf-file", "m.gguf",
               "--write-expect", str(tok / "m.gguf")], "--write-expect .*m.gguf: is the input --gguf-file"),
             (["--endpoint", "http://127.0.0.1:1", "--tokenizer", str(tok), "--write-expect",
               str(tok / "tokenizer.json")], "--write-expect .*tokenizer.json: lies inside the input --tokenizer"),
             (["--launch", "llama-server", "--engine-model", str(model), "--tokenizer", str(tok),
               "--write-expect", str(tmp_path / "alias.gguf")], "is the input --engine-model"),  # a hard link
             (["--endpoint", "http://127.0.0.1:1", "--tokenizer", str(tok), "--expect", str(model),
               "--write-expect", str(model)], "is the input --expect")]
    for flags, match in cases:
        code = main(["audit", *flags, "--out", str(tmp_path / "out")])
        line = one_line(code, capsys.readouterr().err)
        assert __import__("re").search(match, line), line
    assert {**digest(tok), **digest(model)} == before and not (tmp_path / "out").exists()


def test_two_outputs_of_one_command_never_nest(tmp_path, capsys):
    hf_out = tmp_path / "hf"
    code = main(["export", "gguf", "--checkpoint", str(tmp_path / "ck"), "--out", str(hf_out / "m.gguf"),
                 "--hf-out", str(hf_out), "--force"])
    assert "lies inside the output --hf-out" in one_line(code, capsys.readouterr().err)


# ----------------------------------------------------------------------------- per command family


def _run_leaves_only_out(argv: list[str], parent: Path, inputs: list[Path]) -> None:
    """Run `argv` (its --out inside `parent`): it succeeds, adds only --out to `parent`, changes no input."""
    before, hashed = sorted(p.name for p in parent.iterdir()), {k: v for i in inputs for k, v in digest(i).items()}
    out = Path(argv[argv.index("--out") + 1])
    assert main(argv) == 0
    assert sorted(p.name for p in parent.iterdir()) == sorted({*before, out.name})
    assert {k: v for i in inputs for k, v in digest(i).items()} == hashed
    assert not (out / PARTIAL).exists() and (out / MARKER).is_file()


@pytest.mark.parametrize("command", ["eval", "sweep", "knockout", "audit", "train-indexer"])
def test_each_command_writes_only_its_out(command, ws, tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir()
    out = str(parent / "out")
    run, hf = ws / "run", ws / "hf"
    argv = {"eval": ["eval", "--checkpoint", str(run), "--out", out, "--no-progress"],
            "sweep": ["sweep", "--checkpoint", str(run), "--text", VOCAB.words[5], "--a", VOCAB.words[6], "--b",
                      VOCAB.words[7], "--max-filler", "8", "--out", out, "--no-progress"],
            "knockout": ["knockout", "--checkpoint", str(run), "--out", out, "--no-progress"],
            "audit": ["audit", "--hf", str(ws / "model"), "--compress", "none", "--protocol", "prefix", "--records",
                      "24", "--demos", "2", "--prompts-per-phase", "1", "--out", out, "--no-progress"],
            "train-indexer": ["train-indexer", "--hf", str(hf), "--sequences", "4", "--held-out", "2", "--length",
                              "64", "--steps", "2", "--batch", "1", "--threads", "1", "--out", out,
                              "--no-progress"]}[command]
    _run_leaves_only_out(argv, parent, [run, hf, ws / "model"])
    _run_leaves_only_out([*argv, "--force"], parent, [run, hf, ws / "model"])  # --force over its own output


def test_force_over_a_finished_output_keeps_a_users_files(ws, tmp_path, capsys):
    """--force over an output phasekv wrote but a user added to is refused, the user's file kept; a sibling folder
    named like the old grid work folder (OUT.grid) is never touched."""
    out = tmp_path / "out"
    argv = ["eval", "--checkpoint", str(ws / "run"), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    (tmp_path / "out.grid" / "mine").mkdir(parents=True)
    (tmp_path / "out.grid" / "mine" / "notes.txt").write_text("keep")
    (out / "mine").mkdir()
    (out / "mine" / "notes.txt").write_text("keep")
    kept = {**digest(out), **digest(tmp_path / "out.grid")}
    line = one_line(main([*argv, "--force"]), capsys.readouterr().err)
    assert "holds mine/notes.txt, which phasekv did not write" in line
    assert {**digest(out), **digest(tmp_path / "out.grid")} == kept


# ----------------------------------------------------------------------------- train-indexer: NaN, resume keys


def _indexer_argv(hf: Path, out: Path, *extra: str) -> list[str]:
    return ["train-indexer", "--hf", str(hf), "--sequences", "4", "--held-out", "2", "--length", "64", "--steps",
            "3", "--batch", "1", "--threads", "1", "--out", str(out), "--no-progress", *extra]


def test_train_indexer_publishes_nothing_from_nan(ws, tmp_path, capsys, monkeypatch):
    from phasekv.training import distill_indexer

    out = tmp_path / "out"
    real = distill_indexer.distillation_loss

    def nan_in_training(indexers, batch, cfg):
        loss = real(indexers, batch, cfg)
        return loss * float("nan") if torch.is_grad_enabled() else loss

    monkeypatch.setattr(distill_indexer, "distillation_loss", nan_in_training)
    line = one_line(main(_indexer_argv(ws / "hf", out)), capsys.readouterr().err)
    assert "step 0: the loss is nan (not finite); nothing is published" in line
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL, MARKER]  # only the resumable work, no indexer
    monkeypatch.setattr(distill_indexer, "distillation_loss", real)

    def poisoned(indexers, train, cfg, progress=True):
        with torch.no_grad():
            next(iter(indexers.parameters())).fill_(float("inf"))
        return []

    monkeypatch.setattr(distill_indexer, "fit", poisoned)
    line = one_line(main(_indexer_argv(ws / "hf", out)), capsys.readouterr().err)
    assert "of the trained weight" in line and "not finite" in line
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL, MARKER]
    assert "finite" in one_line(main(_indexer_argv(ws / "hf", tmp_path / "o2", "--lr", "inf")),
                                capsys.readouterr().err)


def test_train_indexer_resumes_only_its_own_seed_and_model(ws, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file, save_file

    from phasekv.training import distill_indexer

    out = tmp_path / "out"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_indexer, "fit", killed)
    assert main(_indexer_argv(ws / "hf", out)) == 130
    capsys.readouterr()
    features = out / PARTIAL / distill_indexer.FEATURES_FILE
    assert features.is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    kept = features.read_bytes()
    line = one_line(main(_indexer_argv(ws / "hf", out, "--seed", "1")), capsys.readouterr().err)
    assert "features of an interrupted run of another seed (seed=0; this run: seed=1)" in line
    other = tmp_path / "other"
    other.mkdir()
    for f in (ws / "hf").iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(other / "model.safetensors"))
    weights = {k: v + 1 if k.endswith("q_proj.weight") else v for k, v in weights.items()}
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    line = one_line(main(_indexer_argv(other, out)), capsys.readouterr().err)
    assert "another" in line and "weights" in line and "--force to start over" in line
    assert features.read_bytes() == kept
    monkeypatch.undo()
    monkeypatch.setattr(distill_indexer, "features", killed)  # a resume reuses the features: never recomputed
    assert main(_indexer_argv(ws / "hf", out)) == 0
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "indexer.json", "indexer.safetensors"]


# ----------------------------------------------------------------------------- exporters verify, disks fill


REPO = Path(__file__).resolve().parents[1]
GGUF_CHECKPOINT = REPO / "checkpoints" / "dsv4-csa"


def test_the_gguf_export_reads_back_what_it_wrote_and_a_bad_file_leaves_none(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gguf")
    from phasekv.export import gguf_check

    out = tmp_path / "m.gguf"
    assert main(["export", "gguf", "--checkpoint", str(GGUF_CHECKPOINT), "--out", str(out)]) == 0
    first = out.read_bytes()
    capsys.readouterr()
    real = gguf_check.publish_gguf

    def damaged(tmp, target, expected):  # the disk (or the writer) changed a byte of the last tensor's data
        with open(tmp, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        real(tmp, target, expected)

    monkeypatch.setattr(gguf_check, "publish_gguf", damaged)
    line = one_line(main(["export", "gguf", "--checkpoint", str(GGUF_CHECKPOINT), "--out", str(out), "--force"]),
                    capsys.readouterr().err)
    assert "reads back with another checksum than was written" in line and "nothing was written" in line
    assert out.read_bytes() == first and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]

    def truncated(tmp, target, expected):
        os.truncate(tmp, os.path.getsize(tmp) // 2)
        real(tmp, target, expected)

    monkeypatch.setattr(gguf_check, "publish_gguf", truncated)
    line = one_line(main(["export", "gguf", "--checkpoint", str(GGUF_CHECKPOINT), "--out", str(out), "--force"]),
                    capsys.readouterr().err)
    assert "the written GGUF file does not read back" in line or "lacks or adds tensor" in line, line
    assert out.read_bytes() == first and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def _enospc(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_a_full_disk_during_gguf_export_names_the_bytes_and_keeps_the_old_file(tmp_path, monkeypatch, capsys):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"the previous export")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", _enospc)
    line = one_line(main(["export", "gguf", "--checkpoint", str(GGUF_CHECKPOINT), "--out", str(out), "--force"]),
                    capsys.readouterr().err)
    assert "no space left on" in line and f"writing {out} (needs at least" in line and "bytes free" in line
    assert out.read_bytes() == b"the previous export" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_full_disk_under_an_output_keeps_the_previous_one(tmp_path, monkeypatch):
    from phasekv import outputs

    out = tmp_path / "out"
    with output_dir(out) as tmp:
        write_json(tmp / "summary.json", {"run": 1})
    kept = digest(out)
    real = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, *a, **k: _enospc() if self.name == "summary.json"
                        else real(self, *a, **k))
    with pytest.raises(outputs.OutputError, match=r"no space left on .* writing .*summary.json \(needs at least "
                                                  r"1\d bytes, [\d,]+ bytes free\)"), \
            output_dir(out, force=True) as tmp:
        write_json(tmp / "summary.json", {"run": 2})
    assert digest(out) == kept and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    expect = tmp_path / "expect.json"
    expect.write_text("{}")
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(outputs.OutputError, match=r"writing .*expect.json \(needs at least 15 bytes"):
        write_json(expect, {"run": 2}, atomic=True)
    assert expect.read_bytes() == b"{}" and sorted(p.name for p in tmp_path.iterdir()) == ["expect.json", "out"]


# ----------------------------------------------------------------------------- a reference of another model


def _gguf(path: Path, scale: float) -> Path:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", (np.arange(64, dtype=np.float32) * scale).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_reference_of_other_weights_or_another_vocabulary_is_refused(tmp_path):
    import argparse

    import transformers
    from tokenizers import Tokenizer, models

    from phasekv.cli.flags import check_reference_model

    def words(*vocab):
        return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
            {w: i for i, w in enumerate(["<unk>", *vocab])}, unk_token="<unk>")), unk_token="<unk>")

    (tmp_path / "ref").mkdir()
    served = _gguf(tmp_path / "served.gguf", 1.0)
    args = argparse.Namespace(reference_hf=str(tmp_path / "ref"), tokenizer="tok", gguf_file="m.gguf")
    _gguf(tmp_path / "ref" / "m.gguf", 1.0)  # the same weights, another file: accepted
    check_reference_model(args, words("a", "b"), words("a", "b"), served=str(served))
    with pytest.raises(ValueError, match=r"its vocabulary \(3 tokens, fingerprint \w+\) is not the served model's "
                                         r"\(--tokenizer tok: 3 tokens"):
        check_reference_model(args, words("a", "c"), words("a", "b"))
    _gguf(tmp_path / "ref" / "m.gguf", 2.0)
    with pytest.raises(ValueError, match=r"its weights .*m.gguf \(fingerprint \w+\) are not the served model's"):
        check_reference_model(args, words("a", "b"), words("a", "b"), served=str(served))


def test_a_missing_reference_says_so_before_anything_runs(tmp_path, capsys):
    tok = _tiny_hf(tmp_path, VOCAB.words)
    capsys.readouterr()
    for reference, gguf, match in [(tmp_path / "nowhere", [], "no such model directory"),
                                   (tok, ["--gguf-file", "absent.gguf"], "holds no GGUF file absent.gguf")]:
        code = main(["audit", "--endpoint", "http://127.0.0.1:1", "--tokenizer", str(tok), *gguf, "--reference-hf",
                     str(reference), "--out", str(tmp_path / "out")])
        assert match in one_line(code, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, message", [
    ("heads", 100_000_000, "heads must be <= 1024"),
    ("head_dim", 99_999_999, "head_dim must be <= 4096"),
    ("length", 1 << 30, "length must be <= 1048576"),
    ("seed", 10 ** 23, r"seed must be an integer in \[0, 2\^63\)"),
    ("seed", -1, r"seed must be an integer in \[0, 2\^63\)"),
])
def test_train_indexer_sizes_and_seeds_are_bounded_before_anything_is_allocated(field, value, message):
    from phasekv.training.distill_indexer import IndexerTraining

    with pytest.raises(ValueError, match=message):
        IndexerTraining(**{field: value})
    with pytest.raises(ValueError, match=r"heads x head_dim must be <= 65536"):
        IndexerTraining(heads=1024, head_dim=4096)
