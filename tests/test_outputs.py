"""phasekv.outputs: results are published whole or not at all.  (Kills at every step of publishing, through
`phasekv eval` and `phasekv train`: test_reliability.py.)"""

import os

import pytest

from phasekv.outputs import check_output_dir, output_dir, publish, recover, write_atomic


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


def test_a_failing_command_leaves_the_old_output_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.json").write_text("old")
    with pytest.raises(RuntimeError, match="boom"), output_dir(out, force=True) as tmp:
        (tmp / "new.json").write_text("half")
        raise RuntimeError("boom")
    assert sorted(p.name for p in out.iterdir()) == ["old.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the temporary directory is gone


def test_a_non_empty_out_needs_force_and_force_replaces_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.json").write_text("old")
    with pytest.raises(ValueError, match="exists and is not empty; pass --force"), output_dir(out):
        pass
    with output_dir(out, force=True) as tmp:
        (tmp / "new.json").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.json"]
    (tmp_path / "empty").mkdir()
    with output_dir(tmp_path / "empty") as tmp:  # an empty directory is no result: no --force needed
        (tmp / "x").write_text("x")
    assert (tmp_path / "empty" / "x").is_file()


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


def test_publish_replaces_through_old_and_recover_brings_it_back(tmp_path):
    directory, new = tmp_path / "d", tmp_path / "d.tmp"
    directory.mkdir()
    (directory / "v").write_text("1")
    new.mkdir()
    (new / "v").write_text("2")
    publish(new, directory)
    assert (directory / "v").read_text() == "2" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    # a crash between publish's two renames leaves only d.old: recover (run by every next command) restores it
    os.replace(directory, tmp_path / "d.old")
    recover(directory)
    assert (directory / "v").read_text() == "2" and not (tmp_path / "d.old").exists()
    recover(directory)  # nothing to do
    assert (directory / "v").read_text() == "2"
