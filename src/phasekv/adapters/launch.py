"""Starting an inference engine's server as a child process of phasekv.

`launched(command, url)` runs a server on a loopback port, waits until its health route answers (the model is
loaded), yields its URL and stops it when the block ends, on any exit: the child also asks Linux to end it when
phasekv dies (a killed audit leaves no server behind, which `finally` alone cannot promise).  A server that does
not come up raises `EngineDied` with one line: how it ended (the signal by name: SIGILL is an instruction the
machine cannot run) and the last lines of its log.  `llama_server` builds llama.cpp's command line; `smoke`
loads a model and asks for one token, which `make engine` requires of a binary before installing it.
`vllm_server` and `smoke_vllm` do the same for vLLM's OpenAI server (`make vllm`).
"""

from __future__ import annotations

import contextlib
import ctypes
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
                                       preexec_fn=_die_with_parent)
        except OSError as e:
            raise EngineDied(f"{name} could not be started: {e.strerror or e}") from None
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if process.poll() is not None:
                    raise EngineDied(f"{name} {exit_reason(process.returncode)} before it served: {_tail(log)}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + health, timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise EngineDied(f"{name} not healthy after {startup_s:.0f} s: {_tail(log)}")
                time.sleep(0.2)
            yield url
            if process.poll() is not None:  # it died while serving: say how, not only that requests failed
                raise EngineDied(f"{name} {exit_reason(process.returncode)} while serving: {_tail(log)}")
        finally:
            _stop(process)


def llama_server_command(binary: Path, model: Path, port: int, *, slots: int = 1, context: int = 4096,
                         threads: int = 1, extra: Sequence[str] = ()) -> list[str]:
    """llama.cpp's command line: `slots` parallel sequences sharing `context` tokens, on 127.0.0.1:`port`."""
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-c", str(context), "-np", str(slots), "--no-webui", *extra]


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, *, slots: int = 1, context: int = 4096, threads: int = 1,
                 startup_s: float = 180.0, extra: Sequence[str] = ()) -> Iterator[str]:
    """The URL of a llama-server serving `model` on a free loopback port while the block runs."""
    port = free_port()
    command = llama_server_command(binary, model, port, slots=slots, context=context, threads=threads, extra=extra)
    with launched(command, f"http://127.0.0.1:{port}", name=Path(binary).name, startup_s=startup_s) as url:
        yield url


def smoke(binary: Path, model: Path, startup_s: float = 120.0) -> int:
    """Load `model` in `binary` and ask for one token of a short prompt; the token id it answered.  Raises
    `EngineDied` when the server crashes (SIGILL at the first matrix product is the case this exists for)."""
    with llama_server(binary, model, context=256, startup_s=startup_s) as url:
        try:
            answer = httpx.post(f"{url}/completion", json={"prompt": "one two three four", "n_predict": 1,
                                                            "return_tokens": True, "cache_prompt": False},
                                timeout=startup_s)
            answer.raise_for_status()
            tokens = answer.json()["tokens"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise EngineDied(f"{Path(binary).name} did not answer a one-token request: {e}") from None
        if len(tokens) != 1 or not isinstance(tokens[0], int):
            raise EngineDied(f"{Path(binary).name} answered {tokens!r} to a one-token request")
        return tokens[0]


def vllm_server_command(python: Path, model: Path, port: int, *, context: int = 4096, dtype: str = "float32",
                        cache_root: Path | None = None, kv_cache_gib: int = 1, threads: int = 1,
                        env: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`; `vllm serve` crashes on the CPU build),
    eager (its compiled graphs take 300-400 s and are never reused), on 127.0.0.1:`port`, without a prefix cache and
    reporting cached prompt tokens, so that an audit that asks for no prompt cache gets none and can check it.
    Run through `env`: VLLM_HOST_IP keeps its internal sockets on loopback, VLLM_CACHE_ROOT its caches in
    `cache_root`, VLLM_CPU_KVCACHE_SPACE (GiB) and OMP_NUM_THREADS its memory and cores modest (`env`: more
    NAME=VALUE)."""
    env = [*env, "VLLM_HOST_IP=127.0.0.1", f"VLLM_CPU_KVCACHE_SPACE={kv_cache_gib}", f"OMP_NUM_THREADS={threads}",
           "VLLM_CPU_OMP_THREADS_BIND=nobind",  # the kernel places the threads: the cores are shared
           *([f"VLLM_CACHE_ROOT={cache_root}"] if cache_root is not None else [])]
    return ["env", *env, str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(context), "--dtype", dtype,
            "--enforce-eager", "--no-enable-prefix-caching", "--enable-prompt-tokens-details", *extra]


@contextlib.contextmanager
def vllm_server(python: Path, model: Path, *, context: int = 4096, dtype: str = "float32",
                cache_root: Path | None = None, startup_s: float = 600.0, extra: Sequence[str] = ()) -> Iterator[str]:
    """The URL of a vLLM server (run by `python`, the Python of vLLM's own environment) serving the safetensors
    folder `model` on a free loopback port while the block runs (`extra`: more flags, e.g.
    --enable-prefix-caching, which the later flag wins)."""
    port = free_port()
    command = vllm_server_command(python, model, port, context=context, dtype=dtype, cache_root=cache_root,
                                  extra=extra)
    with launched(command, f"http://127.0.0.1:{port}", name="vllm", startup_s=startup_s) as url:
        yield url


def smoke_vllm(python: Path, model: Path, cache_root: Path | None = None, startup_s: float = 900.0) -> int:
    """Start vLLM on `model` and ask /v1/completions for one token of a token-id prompt; the token id it answered.
    Raises `EngineDied` when the server does not come up or does not answer with a token id."""
    with vllm_server(python, model, context=256, cache_root=cache_root, startup_s=startup_s) as url:
        try:
            served = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            answer = httpx.post(f"{url}/v1/completions", json={
                "model": served, "prompt": [504, 3458, 314], "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "return_tokens_as_token_ids": True}, timeout=startup_s)
            answer.raise_for_status()
            token = answer.json()["choices"][0]["logprobs"]["tokens"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise EngineDied(f"vllm did not answer a one-token request: {e}") from None
        if not (isinstance(token, str) and token.startswith("token_id:")):
            raise EngineDied(f"vllm answered {token!r} to a one-token request, not a token id")
        return int(token[len("token_id:"):])


def _die_with_parent() -> None:
    """In the child: ask Linux to send SIGTERM when the process that started it dies."""
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(log, lines: int = 3) -> str:
    """The log's last `lines` lines, after its first error line (llama.cpp's ` E ` lines) when that is earlier: the
    cause, not only the exit."""
    log.flush()
    log.seek(0)
    text = log.read().strip().splitlines()
    errors = [line for line in text[:-lines] if " E " in line][:1]
    return " | ".join(errors + text[-lines:]) if text else "(no output)"
