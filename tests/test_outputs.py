"""phasekv.outputs: results are published whole or not at all.  (Kills at every step of publishing, through
`phasekv eval` and `phasekv train`: test_reliability.py.)"""

import os
import subprocess

import pytest

from phasekv.outputs import MARKER, append_jsonl, check_output_dir, output_dir, publish, recover, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    write_atomic(path, "old")
    write_atomic(path, b"new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_output_dir_publishes_only_a_complete_directory(tmp_path):
    out = tmp_path / "out"
    with output_dir(out) as tmp:
        assert tmp != out and tmp.parent == out.parent and not out.exists()  # built aside
        (tmp / "metrics.json").write_text("{}")
    assert (out / "metrics.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def phasekv_output(out, files=("old.json",)):
    """A directory as phasekv publishes it: its files and the marker."""
    with output_dir(out) as tmp:
        for name in files:
            (tmp / name).write_text("old")
    return out


def test_a_failing_command_leaves_the_old_output_untouched(tmp_path):
    out = phasekv_output(tmp_path / "out")
    with pytest.raises(RuntimeError, match="boom"), output_dir(out, force=True) as tmp:
        (tmp / "new.json").write_text("half")
        raise RuntimeError("boom")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "old.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the temporary directory is gone


def test_a_non_empty_out_needs_force_and_force_replaces_only_a_phasekv_output(tmp_path):
    out = phasekv_output(tmp_path / "out")
    with pytest.raises(ValueError, match="exists and is not empty; pass --force"), output_dir(out):
        pass
    with output_dir(out, force=True) as tmp:
        (tmp / "new.json").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "new.json"]
    (tmp_path / "empty").mkdir()
    with output_dir(tmp_path / "empty") as tmp:  # an empty directory is no result: no --force needed
        (tmp / "x").write_text("x")
    assert (tmp_path / "empty" / "x").is_file()
    mine = tmp_path / "models"  # a user's directory (say, a checkpoint): --force must not replace it
    mine.mkdir()
    (mine / "model.safetensors").write_text("weights")
    with pytest.raises(ValueError, match="is not a phasekv output"), output_dir(mine, force=True):
        pass
    assert (mine / "model.safetensors").read_text() == "weights"


def test_swap_names_never_collide_with_a_users_files(tmp_path):
    out = phasekv_output(tmp_path / "results")
    users = tmp_path / "results.old"  # the user's own backup beside --out
    users.mkdir()
    (users / "keep.txt").write_text("mine")
    with output_dir(out, force=True) as tmp:
        (tmp / "new.json").write_text("new")
    assert (users / "keep.txt").read_text() == "mine" and sorted(p.name for p in users.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results", "results.old"]


def test_stale_temporaries_of_killed_runs_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    stale = tmp_path / f".out.tmp-{dead.pid}"
    stale.mkdir()
    (stale / "half.json").write_text("x")
    with output_dir(tmp_path / "out") as tmp:
        (tmp / "m.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_out_must_be_a_real_writable_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        check_output_dir(tmp_path / "file", force=True)
    with pytest.raises(ValueError, match="cannot be created, .* is not a directory"):
        check_output_dir(tmp_path / "file" / "out", force=False)
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(ValueError, match="is a symbolic link"):
        check_output_dir(tmp_path / "link", force=True)


def test_publish_swaps_atomically_and_recover_brings_a_swap_copy_back(tmp_path):
    directory, new = tmp_path / "d", tmp_path / "d.tmp"
    directory.mkdir()
    (directory / "v").write_text("1")
    new.mkdir()
    (new / "v").write_text("2")
    publish(new, directory)
    assert (directory / "v").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    # without an atomic exchange, a crash between the two renames leaves only the unique swap copy: recover (run
    # by every next command) restores it; a user's d.old is never taken for it
    (tmp_path / "d.old").mkdir()
    os.replace(directory, tmp_path / ".d.old-123-abcd")
    recover(directory)
    assert (directory / "v").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["d", "d.old"]
    recover(directory)  # nothing to do
    assert (directory / "v").read_text() == "2"


def test_append_jsonl_adds_one_line_and_fsyncs_only_when_durable(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    log = tmp_path / "log.jsonl"
    append_jsonl(log, {"b": 1, "a": [1, 2]})
    assert synced == []  # a plain log line is not fsync'd
    append_jsonl(log, {"b": 1, "a": [1, 2]}, compact=True, durable=True)
    assert len(synced) == 1
    assert log.read_text().splitlines() == ['{"b": 1, "a": [1, 2]}', '{"b":1,"a":[1,2]}']
