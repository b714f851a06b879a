"""Publishing files and directories so that a crash never leaves a half-written result.

Every output is built under a temporary name, flushed to disk (fsync) and renamed into place; a
directory that replaces an old one goes through `NAME.old`, which `recover` renames back if a crash
happened in between.  `output_dir` is the one way commands write their `--out` directory: it refuses
an existing non-empty directory unless `force`, builds the new one in a temporary sibling (so a
symlink planted inside the old `--out` is never followed) and publishes it only when complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (the directory entry itself is flushed)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory` and the directory itself to disk."""
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def write_atomic(path: Path, content: str | bytes) -> None:
    """Write a file under a temporary name, flush it, then rename it into place (never half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    data = content if isinstance(content, bytes) else content.encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish(tmp: Path, directory: Path) -> None:
    """Rename the complete directory `tmp` to `directory`, replacing an old one; durable on return.
    A crash at any moment leaves either the old or the new directory under a known name (`.old`
    is renamed back by `recover`)."""
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(directory, old)
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
        shutil.rmtree(old)
    else:
        os.replace(tmp, directory)
        fsync_dir(directory.parent)


def recover(directory: Path) -> None:
    """After a crash inside `publish`: bring back `directory` from its `.old` copy if it is missing."""
    old = directory.with_name(directory.name + ".old")
    if old.is_dir() and not directory.exists():
        os.replace(old, directory)
        fsync_dir(directory.parent)


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an --out that is a file, a symlink, or (without `force`) a non-empty directory; an --out
    left as `NAME.old` by a crash inside `publish` is first brought back."""
    recover(out)
    if out.is_symlink():
        raise ValueError(f"--out {out}: is a symbolic link; give a real directory path")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out}: exists and is not empty; pass --force to replace it or choose a new "
                         "directory")
    parent = out.absolute().parent  # the nearest existing ancestor must be a writable directory
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: cannot be created, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot be created, {parent} is not writable")


@contextlib.contextmanager
def output_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `out`; on success publish it as `out` (replacing an old
    one only with `force`), on any error remove it and leave `out` as it was."""
    out = Path(out)
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        check_output_dir(out, force)  # nothing appeared at --out meanwhile
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
