"""Publishing files and directories so that a crash never leaves a half-written result.

Every output is built under a temporary name, flushed to disk (fsync) and renamed into place.  A
directory that replaces an old one is swapped with it in ONE atomic step (Linux renameat2 with
RENAME_EXCHANGE), so there is no moment without a destination; where the kernel lacks it, the old one
goes through a swap name unique to the run (`.NAME.old-PID-RANDOM`, never a name a user could own, such
as `NAME.old`), which `recover` renames back if a crash happened in between.  `output_dir` is the one way
commands write their `--out` directory: it refuses an existing non-empty directory unless `force`, and
even with `force` replaces only a directory phasekv wrote (it holds the `MARKER` file, which lists every file
phasekv wrote there: one it does not list is a user's, and `--force` refuses to delete it); it builds the new
one in a temporary sibling (so a symlink planted inside the old `--out` is never followed), publishes it
only when complete, and removes temporary siblings that killed runs left behind.

The write-path rule: a command writes its --out and nothing else beside it but that one temporary sibling, which
lives only while the command runs.  The work a killed run resumes from (journals, finished grid points, computed
features) lives inside --out, in OUT/.partial (`partial_dir`; OUT is made and marked for it), never beside it; an
--out holding only that work is continued with `--resume` or started over with `--force`, and the publish of the
finished OUT replaces it.  The inputs a command reads are never a path it writes (`phasekv.cli`).

`write_json` and `write_jsonl` are the one way phasekv writes a JSON or JSON-lines file: each file keeps the
layout it has always had (indentation, key order), set by the caller.

A write that fails (a full disk, a quota, a read-only file system) is one `OutputError` naming the file or the
output being written and the cause, "no space left on MOUNT writing PATH" (`write_error`), and leaves no partial
file: `write_atomic` removes its temporary, `output_dir` its temporary directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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


class OutputError(OSError):
    """Writing an output failed; the message (one line) names what was written and why."""


# errors only a write gives: with them the output being written is the one to name
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
# an OSError without errno (numpy's "N requested and M written") is a full disk when less than this is free
_NEARLY_FULL = 1 << 20


def _mount_point(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _free_bytes(path: Path) -> int | None:
    with contextlib.suppress(OSError):
        stat = os.statvfs(_mount_point(path))
        return stat.f_bavail * stat.f_frsize
    return None


def write_error(exc: OSError, path: str | Path, needed: int | None = None) -> OutputError:
    """The one-line error of a failed write of `path`: "no space left on MOUNT writing PATH (needs at least N bytes,
    F free)" for a full disk (also when the writer lost the errno; N: `needed`, what the write holds, when known),
    else "cannot write PATH: CAUSE"."""
    if isinstance(exc, OutputError):
        return exc
    path = Path(path)
    free = _free_bytes(path)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) or exc.errno is None and free is not None and free < _NEARLY_FULL:
        quota = " (the disk quota)" if exc.errno == errno.EDQUOT else ""
        need = f"needs at least {needed:,} bytes, " if needed else ""
        return OutputError(f"no space left on {_mount_point(path)}{quota} writing {path} ({need}{free or 0:,} bytes "
                           "free); free some space or write elsewhere")
    cause = exc.strerror or " ".join(str(exc).split()) or type(exc).__name__
    return OutputError(f"cannot write {path}: {cause}")


def _full(exc: OSError, path: str | Path) -> bool:
    free = _free_bytes(Path(path)) if exc.errno is None else None
    return exc.errno in _WRITE_ERRNOS or free is not None and free < _NEARLY_FULL


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (what a write had put there when it failed)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@contextlib.contextmanager
def writing(path: str | Path, block: bool = False, needed: Any = None) -> Iterator[None]:
    """Turn a failed write inside the block into `write_error` naming `path` (or the file the error names).
    `block`: the block does more than write (`output_dir`'s), so only errors that writes alone give (a full disk,
    a read-only file system) are turned; others keep their own message.  `needed`: the bytes the write holds, or a
    function that counts them when it failed."""
    try:
        yield
    except OutputError:
        raise
    except OSError as exc:
        if _full(exc, exc.filename or path) or not block and exc.filename is None:
            raise write_error(exc, exc.filename or path, needed() if callable(needed) else needed) from None
        raise


def write_atomic(path: Path, content: str | bytes) -> None:
    """Write a file under a temporary name, flush it, then rename it into place (never half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    data = content if isinstance(content, bytes) else content.encode()
    try:
        with writing(path, needed=len(data)), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)



def write_json(path: Path, data: Any, *, indent: int = 2, sort_keys: bool = True, end: str = "\n",
               default: Any = None, atomic: bool = False) -> Path:
    """`data` as JSON in `path` (`end` after it; `default` as json.dumps's); `atomic`: through `write_atomic`
    (for a file published by itself, not inside an `output_dir`)."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, default=default) + end
    if atomic:
        write_atomic(path, text)
    else:
        with writing(path, needed=len(text.encode())):
            path.write_text(text)
    return path


def write_jsonl(path: Path, rows: Any, *, sort_keys: bool = False) -> Path:
    """One JSON object per line."""
    with writing(path), open(path, "w") as f:
        f.writelines(json.dumps(row, sort_keys=sort_keys) + "\n" for row in rows)
    return path


def append_jsonl(path: Path, row: Any, *, sort_keys: bool = False, compact: bool = False,
                 durable: bool = False) -> Path:
    """`row` as one more JSON line at the end of `path` (a log that grows: a kill leaves at most a torn last line,
    which its readers skip).  `compact` drops the spaces after separators; `durable` fsyncs the line before
    returning (a journal whose every line must survive a crash)."""
    separators = (",", ":") if compact else None
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=sort_keys, separators=separators) + "\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return path


# the layouts' versions, written into the files as `schema_version` (docs/results.md: the JSON schemas); raised when a
# field is removed, renamed or changes meaning
METRICS_SCHEMA_VERSION = 1  # metrics.json of eval, and of each audit condition and protocol
SUMMARY_SCHEMA_VERSION = 1  # summary.json of audit
MARKER = ".phasekv-output"  # every directory `output_dir` publishes holds this file: --force replaces only those
PARTIAL = ".partial"  # a run's resumable work (journals, finished grid points, features) inside its --out
_MARKED = "written by phasekv: `--force` may replace this directory"
_MANIFEST = "files:"  # the marker's line after which it lists every file phasekv wrote there, one a line
_RENAME_EXCHANGE = 2  # renameat2 flag (linux/fs.h)
# PHASEKV_RENAME_EXCHANGE=0 takes the two-rename path (for file systems that refuse the exchange; and its tests)
_USE_EXCHANGE = os.environ.get("PHASEKV_RENAME_EXCHANGE", "1") != "0"
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (renameat2 RENAME_EXCHANGE); False where the system lacks it."""
    if not _USE_EXCHANGE:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_name(directory: Path) -> Path:
    return directory.with_name(f".{directory.name}.old-{os.getpid()}-{secrets.token_hex(4)}")


def publish(tmp: Path, directory: Path) -> None:
    """Rename the complete directory `tmp` to `directory`, replacing an old one; durable on return.
    With an atomic exchange there is no moment without `directory`; otherwise a crash leaves the old
    directory under its unique swap name, which `recover` renames back."""
    if not directory.exists():
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
        return
    if _exchange(tmp, directory):  # tmp now holds the old directory
        fsync_dir(directory.parent)
        shutil.rmtree(tmp)
        return
    old = _swap_name(directory)
    os.replace(directory, old)
    os.replace(tmp, directory)
    fsync_dir(directory.parent)
    shutil.rmtree(old)


def recover(directory: Path) -> None:
    """After a crash inside `publish`: bring back `directory` from its swap copy if it is missing."""
    if directory.exists() or not directory.parent.is_dir():
        return
    swaps = sorted(directory.parent.glob(f".{directory.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if swaps and swaps[-1].is_dir():
        os.replace(swaps[-1], directory)
        fsync_dir(directory.parent)


def _remove_stale_temporaries(out: Path) -> None:
    """Temporary siblings `.NAME.tmp-PID` of runs that were killed (their process is gone)."""
    if not out.parent.is_dir():
        return
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)) and tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _symlink_loop(path: Path) -> Path | None:
    """The first of `path`'s ancestors (or `path` itself) whose resolution fails with ELOOP, or None."""
    path = path.absolute()
    for candidate in (*reversed(path.parents), path):
        try:
            os.stat(candidate)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return candidate
    return None


def out_path(out: str | Path) -> Path:
    """--out as an absolute path, `.` and `..` resolved (the symlinks are not: `check_output_dir` refuses them)."""
    path = Path(os.path.abspath(out))
    if not path.name:
        raise ValueError(f"--out {out}: is the root directory; give a directory to write")
    return path


def written_files(directory: Path) -> list[str]:
    """Every file under `directory` (relative, sorted) but the marker and the run's `PARTIAL` work."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if (p.is_file() or p.is_symlink()) and p.name != MARKER
                  and p.relative_to(directory).parts[0] != PARTIAL)


def foreign_files(out: Path) -> list[str]:
    """The files in the phasekv output `out` that its marker does not list (a user's): `--force` keeps them.
    A marker of an older phasekv lists nothing: its directory is phasekv's whole."""
    lines = (out / MARKER).read_text(errors="replace").splitlines()
    if _MANIFEST not in lines:
        return []
    listed = set(lines[lines.index(_MANIFEST) + 1:])
    return [f for f in written_files(out) if f not in listed]


def unfinished(out: Path) -> bool:
    """`out` holds only a run's resumable work (its marker and `PARTIAL`): a run killed before it published."""
    names = {p.name for p in out.iterdir()}
    return MARKER in names and PARTIAL in names and names <= {MARKER, PARTIAL}


def _check_existing(out: Path, force: bool, resume: bool) -> None:
    """An existing non-empty --out: continued (`resume`) or replaced (`force`) only when phasekv wrote it all."""
    if unfinished(out):
        if not (force or resume):
            raise ValueError(f"--out {out}: holds the work of an interrupted run ({out / PARTIAL}); pass --resume to "
                             "continue it or --force to start over")
        return
    if not force:
        raise ValueError(f"--out {out}: exists and is not empty; pass --force to replace it or choose a new "
                         "directory")
    if not (out / MARKER).is_file():
        raise ValueError(f"--out {out}: is not a phasekv output (it has no {MARKER} file), so --force will not "
                         "replace it; choose a new directory or remove it yourself")
    foreign = foreign_files(out)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ValueError(f"--out {out}: holds {foreign[0]}{more}, which phasekv did not write, so --force will not "
                         "replace it; move them away or choose a new directory")


def check_output_dir(out: str | Path, force: bool, resume: bool = False) -> None:
    """Refuse an --out that is a file, a symlink (or lies under a symlink loop), or a non-empty directory but one
    phasekv wrote all of with `force`, or one holding only an interrupted run's work with `resume` or `force`; an
    --out left under its swap name by a crash inside `publish` is first brought back."""
    out = out_path(out)
    loop = _symlink_loop(out)
    if loop is not None:
        raise ValueError(f"--out {out}: {loop} is a symbolic link loop (it resolves to itself); remove it or choose "
                         "another directory")
    recover(out)
    if out.is_symlink():
        raise ValueError(f"--out {out}: is a symbolic link; give a real directory path")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        _check_existing(out, force, resume)
    parent = out.absolute().parent  # the nearest existing ancestor must be a writable directory
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: cannot be created, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot be created, {parent} is not writable")


def mark(directory: Path, files: list[str] | None = None) -> None:
    """Mark `directory` as a phasekv output (`--force` may replace only such directories), listing `files`, the
    files phasekv wrote there (`foreign_files`: any other is a user's, which `--force` keeps)."""
    listing = "" if files is None else "".join(f"{f}\n" for f in [_MANIFEST, *files])
    (directory / MARKER).write_text(f"{_MARKED}\n{listing}")


def add_written(out: Path, *names: str) -> None:
    """List `names`, files phasekv added to the output `out` after it was published, in its marker (so `--force`
    replaces them as its own)."""
    lines = (out / MARKER).read_text(errors="replace").splitlines()
    if _MANIFEST in lines:  # an older marker lists nothing: the whole directory is phasekv's anyway
        mark(out, sorted(set(lines[lines.index(_MANIFEST) + 1:]) | set(names)))


def publish_checked(tmp: Path, out: Path, force: bool) -> None:
    """List `tmp`'s files in its marker, flush it, check `out` again (nothing appeared there meanwhile; the work of
    this run may be there) and publish."""
    mark(tmp, written_files(tmp))
    fsync_tree(tmp)
    check_output_dir(out, force, resume=True)
    publish(tmp, out)


@contextlib.contextmanager
def output_dir(out: str | Path, force: bool = False, resume: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `out`; on success publish it as `out` (replacing an old
    one only with `force`, or the work of an interrupted run with `resume`), on any error remove it and leave
    `out` as it was."""
    out = out_path(out)
    check_output_dir(out, force, resume)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        with writing(out, block=True, needed=lambda: tree_bytes(tmp)):
            mark(tmp)
            yield tmp
            publish_checked(tmp, out, force)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_CREATED = "created for the run's work"  # the marker's line in an --out that `partial_dir` made (`drop_partial`)


def partial_dir(out: str | Path, *, force: bool, resume: bool) -> Path:
    """OUT/.partial, the resumable work of a run that publishes OUT (journals, finished grid points, features): OUT
    is made and marked first if missing, so the work never lies beside OUT; the publish of OUT removes it.  An
    existing one is continued with `resume`, emptied with `force` (phasekv's own files), else refused."""
    out = out_path(out)
    work = out / PARTIAL
    if work.exists() and not resume:
        if not force:
            raise ValueError(f"{work}: the work of an interrupted run exists: pass --resume to continue it or --force "
                             "to start over")
        shutil.rmtree(work)
    if not out.is_dir():
        out.mkdir(parents=True)
        (out / MARKER).write_text(f"{_MARKED}\n{_CREATED}\n")
    elif not (out / MARKER).exists():  # an empty --out given by the user
        mark(out)
    work.mkdir(exist_ok=True)
    return work


def drop_partial(out: str | Path) -> None:
    """Remove OUT's `PARTIAL` folder when it is empty (a run refused before it did any work), and OUT itself when
    `partial_dir` made it and nothing else is in it: such a run leaves nothing behind."""
    out = out_path(out)
    with contextlib.suppress(OSError):
        (out / PARTIAL).rmdir()
    marker = out / MARKER
    if not out.is_dir():
        return
    if {p.name for p in out.iterdir()} == {MARKER} and _CREATED in marker.read_text(errors="replace"):
        marker.unlink()
        out.rmdir()
