"""Starting an inference engine's server as a child process of phasekv.

`launched(command, url)` runs a server on a loopback port, waits until its health route answers (the model is
loaded), yields its URL and stops it when the block ends, on any exit: the child also asks Linux to end it when
phasekv dies (a killed audit leaves no server behind, which `finally` alone cannot promise).  A server that does
not come up raises `EngineDied` with one line: how it ended (the signal by name: SIGILL is an instruction the
machine cannot run) and the last lines of its log.  The engines' own command lines are in their files
(`phasekv.engines.llama_cpp`, `vllm`, `sglang`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx


class EngineDied(RuntimeError):
    """A launched server exited, or never became healthy; the message is one line."""


def free_port() -> int:
    """A loopback TCP port nobody listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_reason(returncode: int) -> str:
    """How a child process ended, in words: 'killed by SIGILL (Illegal instruction)' or 'exited with status 1'."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"killed by signal {-returncode}"
        return f"killed by {sig.name} ({signal.strsignal(sig)})"
    return f"exited with status {returncode}"


@contextlib.contextmanager
def launched(command: Sequence[str], url: str, *, name: str, health: str = "/health",
             startup_s: float = 180.0) -> Iterator[str]:
    """Run `command` (a server that will listen at `url`), yield `url` once `url + health` answers 200, stop the
    server when the block ends.  Raises `EngineDied` naming `name`, its exit and its log's last lines."""
    with tempfile.NamedTemporaryFile("w+", prefix=f"{Path(name).name}-", suffix=".log") as log:
        try:
            process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                       preexec_fn=_die_with_parent, start_new_session=True)
        except OSError as e:
            raise EngineDied(f"{name} could not be started: {e.strerror or e}") from None
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if process.poll() is not None:
                    raise EngineDied(f"{name} {exit_reason(process.returncode)} before it served: {_tail(log)}")
                if _healthy(url + health):
                    break
                if time.monotonic() > deadline:
                    raise EngineDied(f"{name} not healthy after {startup_s:.0f} s: {_tail(log)}")
                time.sleep(0.2)
            yield url
            if process.poll() is not None:  # it died while serving: say how, not only that requests failed
                raise EngineDied(f"{name} {exit_reason(process.returncode)} while serving: {_tail(log)}")
        finally:
            _stop(process)


HEALTH_BYTES = 64 << 10  # a health answer is a few bytes: more is not a server's health route


def _healthy(url: str) -> bool:
    """Whether `url` answers 200 within 2 s, reading at most HEALTH_BYTES of an answer that may never end."""
    deadline = time.monotonic() + 2.0
    try:
        with httpx.stream("GET", url, timeout=2) as response:
            read = 0
            for chunk in response.iter_bytes():
                read += len(chunk)
                if read > HEALTH_BYTES or time.monotonic() > deadline:
                    return False
            return response.status_code == 200
    except httpx.HTTPError:
        return False


def _die_with_parent() -> None:
    """In the child: ask Linux to KILL it when the process that started it dies (SIGKILL: a server that ignores
    SIGTERM must not outlive a killed phasekv)."""
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


STOP_GRACE_S = 20.0


def _stop(process: subprocess.Popen) -> None:
    """TERM to the server's whole process group (its workers too), KILL after STOP_GRACE_S."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # whatever of the group is left
    process.wait()


def _tail(log, lines: int = 3) -> str:
    """The log's last `lines` lines, after its first error line (llama.cpp's ` E ` lines) when that is earlier: the
    cause, not only the exit."""
    log.flush()
    log.seek(0)
    text = log.read().strip().splitlines()
    errors = [line for line in text[:-lines] if " E " in line][:1]
    return " | ".join(errors + text[-lines:]) if text else "(no output)"
