"""The real inference engines for the end-to-end tests: llama.cpp's llama-server (`make engine` builds it) and
vLLM (`make vllm` installs it).

`llama_server(model_file)` starts the binary on a free loopback port, waits until /health answers (the model
is loaded) and stops it on exit; `vllm_server(dtype)` does the same for vLLM's OpenAI server.  `CountingProxy`
forwards requests to a server and counts the prompts it sees, so a test can prove that no prompt was sent twice.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from phasekv.engines.journal import prompt_key
from phasekv.engines.llama_cpp import llama_server as start_llama_server
from phasekv.engines.vllm import vllm_server as start_vllm_server
from tests.helpers import REAL_MODEL_PRESENT, SMOL, SMOL_FILE

# where `make engine` puts the binary (the Makefile's ENGINE)
ENGINE = Path(os.environ.get("PHASEKV_ENGINE", Path.home() / ".cache" / "phasekv" / "llama.cpp"))
LLAMA_SERVER = ENGINE / "bin" / "llama-server"
engine_present = LLAMA_SERVER.is_file() and REAL_MODEL_PRESENT


def llama_server(model: Path = SMOL / SMOL_FILE, slots: int = 4, context: int = 8192, threads: int = 1,
                 startup_s: float = 180.0, extra: tuple[str, ...] = ()):
    """The URL of the built llama-server serving `model` with `slots` parallel sequences of `context // slots` tokens
    each (`extra`: more flags), stopped when the block ends; a server that dies says how in one line
    (`phasekv.engines.process.EngineDied`: its signal by name and its log's last lines)."""
    return start_llama_server(LLAMA_SERVER, model, slots=slots, context=context, threads=threads,
                               startup_s=startup_s, extra=extra)


# where `make vllm` puts vLLM's environment and the SmolLM2 folder it serves (the Makefile's VLLM)
VLLM = Path(os.environ.get("PHASEKV_VLLM", Path.home() / ".cache" / "phasekv" / "vllm"))
VLLM_PYTHON, VLLM_MODEL = VLLM / "venv" / "bin" / "python", VLLM / "smollm2"
vllm_present = (VLLM / "recipe").is_file() and VLLM_PYTHON.is_file() and (VLLM_MODEL / "config.json").is_file()


def vllm_server(dtype: str = "float32", context: int = 4096, startup_s: float = 900.0, extra: tuple[str, ...] = ()):
    """The URL of vLLM serving `make vllm`'s SmolLM2 folder in `dtype`, eager, with no prefix cache and the cached
    prompt tokens reported (`extra`: more flags, the later winning), stopped when the block ends; one line on
    failure as for llama-server.  Startup takes 1-3 minutes on this machine's 2 cores."""
    return start_vllm_server(VLLM_PYTHON, VLLM_MODEL, context=context, dtype=dtype, cache_root=VLLM / "cache",
                              startup_s=startup_s, extra=extra)


class LoopbackServer:
    """A stdlib HTTP server on a free loopback port (`url`), serving its request handler on a thread while the
    `with` block runs; subclasses build the handler and call `_serve(handler)`."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass


class Proxy(LoopbackServer):
    """A loopback proxy with its own client to the target, closed with the server."""

    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self._client = httpx.Client(timeout=600)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._client.close()


def reply(handler: BaseHTTPRequestHandler, answer: httpx.Response) -> None:
    """Send a forwarded answer back to the proxy's client (which may have been killed meanwhile)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        handler.send_response(answer.status_code)
        handler.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
        handler.send_header("Content-Length", str(len(answer.content)))
        handler.end_headers()
        handler.wfile.write(answer.content)


class CountingProxy(Proxy):
    """A loopback HTTP proxy to `target` that counts the prompts of the POSTs it forwards, by their journal key
    (`phasekv.engines.journal.prompt_key` of the body's "prompt" or "input_ids")."""

    def __init__(self, target: str):
        super().__init__(target)
        self.prompts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(QuietHandler):
            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = json.loads(body)
                with proxy._lock:
                    proxy.prompts[prompt_key(request.get("prompt", request.get("input_ids")))] += 1
                self._forward(body)

            def _forward(self, body):
                try:
                    answer = proxy._client.request(self.command, proxy.target + self.path, content=body,
                                                   headers={"Content-Type": "application/json"})
                except httpx.TransportError:
                    self.send_error(502)
                    return
                reply(self, answer)

        self._serve(Handler)


class CorruptingProxy(Proxy):
    """A loopback HTTP proxy to a llama.cpp server that plants a phase bug: the answer to every /completion prompt
    whose length is `residue` mod `modulus` has its top-2 tokens swapped (the greedy token becomes the runner-up,
    the shape of vLLM #55927); `on=False` forwards everything unchanged.  Other routes pass through.
    `wrong`: another bug shape, a predicate on the prompt's token ids that picks the answers to swap (e.g. a length
    threshold or a rate growing with the length), instead of the residue.  `cache`: a dict shared by several proxies
    in front of one server, holding the server's answers by request body, so that a prompt several audits send
    reaches the server once (the bug is applied after the cache)."""

    def __init__(self, target: str, residue: int = 0, modulus: int = 4, on: bool = True,
                 wrong: Callable[[list[int]], bool] | None = None, cache: dict[bytes, httpx.Response] | None = None):
        super().__init__(target)
        self.residue, self.modulus, self.on, self.corrupted = residue, modulus, on, 0
        self.wrong = wrong or (lambda ids: len(ids) % self.modulus == self.residue)
        proxy = self

        def forward(body: bytes) -> httpx.Response:
            if cache is not None and body in cache:
                return cache[body]
            answer = proxy._client.post(proxy.target + "/completion", content=body,
                                        headers={"Content-Type": "application/json"})
            if cache is not None and answer.status_code == 200:
                cache[body] = answer
            return answer

        class Handler(QuietHandler):
            def do_GET(self):
                reply(self, proxy._client.get(proxy.target + self.path))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/completion":
                    reply(self, proxy._client.post(proxy.target + self.path, content=body,
                                                   headers={"Content-Type": "application/json"}))
                    return
                answer = forward(body)
                request = json.loads(body)
                if proxy.on and answer.status_code == 200 and proxy.wrong(list(request["prompt"])):
                    payload = answer.json()
                    step = payload["completion_probabilities"][0]
                    top = sorted(step["top_logprobs"], key=lambda t: -t["logprob"])
                    if len(top) >= 2:
                        top[0]["logprob"], top[1]["logprob"] = top[1]["logprob"], top[0]["logprob"]
                        step["top_logprobs"], step["id"] = [top[1], top[0], *top[2:]], top[1]["id"]
                        with proxy._lock:
                            proxy.corrupted += 1
                    answer = httpx.Response(200, json=payload)
                reply(self, answer)

        self._lock = threading.Lock()
        self._serve(Handler)
