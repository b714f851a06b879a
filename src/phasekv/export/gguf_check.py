"""Reading back a GGUF file before it is published: `write_gguf` says it wrote a file only when the file holds what
it wrote, every tensor under its name, with its shape, dtype and bytes (a SHA-256 of each), and nothing else."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


def fingerprint(array: Any) -> tuple[tuple[int, ...], str, str]:
    """(shape, dtype, SHA-256 of the bytes) of a tensor as it is handed to the GGUF writer."""
    return tuple(array.shape), str(array.dtype), hashlib.sha256(array.tobytes()).hexdigest()


def tensor_bytes(expected: dict[str, tuple[tuple[int, ...], str, str]]) -> int:
    """The bytes of the tensors' data (`fingerprint`s): what a GGUF file of them needs at least."""
    import numpy as np

    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype, _ in expected.values())


def verify_gguf(path: Path, expected: dict[str, tuple[tuple[int, ...], str, str]], shown: Path) -> None:
    """Refuse, in one line naming `shown` (the file being published) and the first difference, a written GGUF file
    whose tensors are not `expected` ({name: `fingerprint`})."""
    import gguf

    from phasekv.outputs import OutputError

    try:
        tensors = {t.name: fingerprint(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    except (ValueError, OSError, IndexError) as exc:
        raise OutputError(f"{shown}: the written GGUF file does not read back ({' '.join(str(exc).split())[:120]}); "
                          "nothing was written") from None
    missing = sorted(set(expected) - set(tensors)) or sorted(set(tensors) - set(expected))
    if missing:
        raise OutputError(f"{shown}: the written GGUF file lacks or adds tensor {missing[0]}; nothing was written")
    for name, want in expected.items():
        if tensors[name] != want:
            what = ("shape" if tensors[name][0] != want[0] else "dtype" if tensors[name][1] != want[1] else
                    "checksum")
            raise OutputError(f"{shown}: tensor {name} reads back with another {what} than was written ("
                              f"{tensors[name][0 if what == 'shape' else 1 if what == 'dtype' else 2]}, written "
                              f"{want[0 if what == 'shape' else 1 if what == 'dtype' else 2]}); nothing was written")


def publish_gguf(tmp: Path, out: Path, expected: dict[str, tuple[tuple[int, ...], str, str]]) -> None:
    """The written temporary file `tmp`, flushed, read back (`verify_gguf`) and renamed to `out`."""
    from phasekv.outputs import fsync_dir

    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    verify_gguf(tmp, expected, out)
    os.replace(tmp, out)
    fsync_dir(out.parent)


def weights_fingerprint(path: Path) -> str:
    """A GGUF file's weights, identified: every tensor's name, shape, type and the first and last bytes of its data
    (two exports of one model agree; another model, or the same one re-quantized, does not)."""
    import gguf

    digest = hashlib.sha256()
    for t in sorted(gguf.GGUFReader(str(path)).tensors, key=lambda t: t.name):
        data = t.data.reshape(-1).view("uint8") if t.data.size else t.data
        digest.update(f"{t.name}{tuple(int(n) for n in t.shape)}{int(t.tensor_type)}".encode())
        digest.update(bytes(data[:64]) + bytes(data[-64:]))
    return digest.hexdigest()[:16]
