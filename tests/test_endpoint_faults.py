"""Faults of a served model, injected between phasekv's endpoint adapter and the REAL llama-server (tests/engine.py).

`FaultProxy` is a loopback HTTP proxy (stdlib threads) that forwards to the server and, on chosen requests, drops
the connection before forwarding, loses the answer after the server computed it, answers past the client's timeout,
answers 503, cuts the body short, answers garbled JSON, or names another model (in the answer, or in /props as a
restarted server would).  Every audit must either finish with the summary of a clean run or stop with one line and,
resumed with --resume, finish with that summary; and no prompt may be asked again once an answer to it was delivered
(the proxy logs every request and every complete clean delivery, per prompt).  Small on purpose: 8 prompts of about
75 tokens, one request in flight (the n-th request is the fault's).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from phasekv.cli import main
from phasekv.engines.journal import journal_path, prompt_key
from phasekv.outputs import unfinished
from tests.engine import LoopbackServer, engine_present, llama_server
from tests.helpers import SMOL, SMOL_FILE, needs_real

needs_engine = needs_real(engine_present, "llama-server not built (make engine) or real model absent (make real-model)")
TIMEOUT_S = 3  # --timeout; a "slow" answer comes after SLOW_S
SLOW_S = TIMEOUT_S + 1.5


class FaultProxy(LoopbackServer):
    """Forwards to `target`; `faults[n]` is what happens to the n-th POST (1-based); with `down`, every request
    after the first `down` POSTs is dropped (a server that stopped); `props_model` rewrites /props' model_path."""

    def __init__(self, target: str, faults: dict[int, str] | None = None, down: int | None = None,
                 props_model: str | None = None):
        self.faults, self.down, self.props_model = faults or {}, down, props_model
        self.posts = 0
        self.log: list[tuple[str, str]] = []  # ("asked" | "answered", prompt key), in order
        self._lock = threading.Lock()
        host = urlsplit(target)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._relay(None, None, None)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                key = prompt_key(json.loads(body)["prompt"])
                with proxy._lock:
                    proxy.posts += 1
                    n = proxy.posts
                    proxy.log.append(("asked", key))
                kind = "drop" if proxy.down is not None and n > proxy.down else proxy.faults.get(n)
                self._relay(body, key, kind)

            def _relay(self, body, key, kind):
                if kind == "drop":  # refused before the server saw it: the connection closes, no answer
                    return
                if kind == "slow":  # the client has given up before anything comes
                    time.sleep(SLOW_S)
                    return
                if kind == "503":
                    self._send(503, json.dumps({"error": {"message": "loading model"}}).encode())
                    return
                server = http.client.HTTPConnection(host.hostname, host.port, timeout=60)
                try:
                    server.request(self.command, self.path, body, {"Content-Type": "application/json"})
                    answer = server.getresponse()
                    status, data = answer.status, answer.read()
                finally:
                    server.close()
                if kind == "lost":  # computed by the server, lost on the way back
                    return
                if self.path == "/props" and proxy.props_model:
                    data = json.dumps({**json.loads(data), "model_path": proxy.props_model}).encode()
                if kind == "model":
                    data = json.dumps({**json.loads(data), "model": "/models/another.gguf"}).encode()
                if kind == "garbled":
                    data = data[: len(data) // 2]  # a complete HTTP answer whose JSON is cut
                if kind == "truncate":  # the headers promise the whole body, the connection closes halfway
                    self._send(status, data, cut=len(data) // 2)
                    return
                self._send(status, data)
                if key is not None and kind is None:
                    with proxy._lock:
                        proxy.log.append(("answered", key))

            def _send(self, status, data, cut=None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data if cut is None else data[:cut])
                self.wfile.flush()

            def log_message(self, *args):  # quiet
                pass

        self._serve(Handler)  # ThreadingHTTPServer's request threads are daemons


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server URL, tokenizer directory): the GGUF's tokenizer saved once as files (loading it from the GGUF on
    every run would dominate the test's time)."""
    from transformers import AutoTokenizer

    tokenizer = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(str(SMOL), gguf_file=SMOL_FILE).save_pretrained(tokenizer)
    with llama_server(slots=1, context=2048) as url:
        yield url, tokenizer


# 8 prompts (stride 2, both protocols) of about 75 tokens: a second or less each through llama-server on a busy core
AUDIT = ["--api", "llamacpp", "--format", "records", "--stride", "2", "--records", "4", "--demos", "1",
         "--local-window", "4", "--prompts-per-phase", "1", "--timeout", str(TIMEOUT_S), "--no-progress"]


def audit(url: str, tokenizer: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    """(exit status, the stderr line) of `phasekv audit --endpoint URL` on the small prompt set: exit 0 and nothing
    on stderr, or exit 2 and one line."""
    capsys.readouterr()
    code = main(["audit", "--endpoint", url, "--tokenizer", str(tokenizer), *AUDIT, "--out", str(out), *extra])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 0 and not err or code == 2 and len(err) == 1, (code, err)
    return code, err[0] if err else ""


def summary(out: Path) -> dict:
    tree = json.loads((out / "summary.json").read_text())
    tree.pop("elapsed_s")
    return tree


def never_asked_after_answered(*proxies: FaultProxy) -> dict[str, int]:
    """Clean deliveries per prompt over the proxies' logs in order; fails if a prompt was asked after one."""
    answered: dict[str, int] = {}
    for proxy in proxies:
        for event, key in proxy.log:
            if event == "asked":
                assert key not in answered, "a prompt was asked again after its answer was delivered"
            else:
                answered[key] = answered.get(key, 0) + 1
    return answered


@pytest.fixture(scope="module")
def clean(served, tmp_path_factory):
    """(summary, prompts) of the audit through a proxy that injects nothing: each prompt asked and answered once."""
    url, tokenizer = served
    out = tmp_path_factory.mktemp("clean") / "run"
    with FaultProxy(url) as proxy:
        assert main(["audit", "--endpoint", proxy.url, "--tokenizer", str(tokenizer), *AUDIT, "--out", str(out)]) == 0
    answered = never_asked_after_answered(proxy)
    assert proxy.posts == len(answered) and set(answered.values()) == {1}
    return summary(out), proxy.posts


@needs_engine
def test_transient_faults_are_retried_to_the_clean_summary(served, clean, tmp_path, capsys):
    url, tokenizer = served
    reference, n_prompts = clean
    faults = {2: "drop", 4: "lost", 6: "slow", 8: "503", 10: "truncate"}
    start = time.perf_counter()
    with FaultProxy(url, faults) as proxy:
        assert audit(proxy.url, tokenizer, tmp_path / "run", capsys) == (0, "")
    print(f"\nfive retried faults: {time.perf_counter() - start:.1f} s")
    assert proxy.posts == n_prompts + len(faults)  # each fault cost exactly one more request
    assert list(never_asked_after_answered(proxy).values()) == [1] * n_prompts
    assert summary(tmp_path / "run") == reference
    record = json.loads((tmp_path / "run" / "endpoint.json").read_text())
    assert record["requests_this_run"] == record["answers"] == n_prompts


@needs_engine
def test_faults_that_outlast_the_retries_stop_in_one_line_and_resume_to_the_clean_summary(served, clean, tmp_path,
                                                                                          capsys):
    url, tokenizer = served
    reference, n_prompts = clean
    out = tmp_path / "run"
    journal = journal_path(out)
    # (proxy settings, --resume, what the one line says, requests sent: none after the one that failed)
    stops = [(dict(faults={n: "503" for n in range(3, 7)}), False, "HTTP 503 (loading model), after 4 tries", 6),
             (dict(faults={2: "garbled"}), True, "answered non-JSON", 2),
             (dict(down=2), True, "cannot reach the server", 6),
             (dict(faults={2: "model"}), True, "answered with model '/models/another.gguf'", 2),
             (dict(props_model="/models/another.gguf"), True, "written with other settings", 0)]
    proxies, answered = [], []
    start = time.perf_counter()
    for settings, resume, message, posts in stops:
        with FaultProxy(url, **settings) as proxy:
            code, line = audit(proxy.url, tokenizer, out, capsys, *(["--resume"] if resume else []))
        proxies.append(proxy)
        assert code == 2 and message in line and proxy.posts == posts, (settings, line, proxy.posts)
        assert unfinished(out) and journal.exists()  # OUT holds only the run's work (OUT/.partial)
        answered.append(len(journal.read_text().splitlines()) - 2)  # the header and the prompt set's line
    assert answered == [2, 3, 5, 6, 6] and n_prompts > 6  # each stop kept what had been answered, and only that
    with FaultProxy(url) as proxy:
        assert audit(proxy.url, tokenizer, out, capsys, "--resume") == (0, "")
    proxies.append(proxy)
    print(f"\nfive stops and a resume: {time.perf_counter() - start:.1f} s")
    assert list(never_asked_after_answered(*proxies).values()) == [1] * n_prompts
    assert summary(out) == reference
    record = json.loads((out / "endpoint.json").read_text())
    assert record["answers"] == n_prompts and record["answers_from_journal"] == answered[-1]
    assert not journal.exists()  # moved into the published OUT


# ----------------------------------------------------------------------------- a server that does not come up


def test_a_server_killed_by_a_signal_is_named_in_one_line(tmp_path):
    """A server that dies before serving (here a shell that kills itself with SIGILL, as llama-server did on AMX
    machines) is reported with the signal's name and its last log line, not as a timeout or a bare -4."""
    from phasekv.engines.process import EngineDied, launched

    script = "echo loading model; echo tinygemm_kernel_amx; kill -ILL $$"
    with pytest.raises(EngineDied) as caught, launched(["sh", "-c", script], "http://127.0.0.1:9", name="fake",
                                                        startup_s=30):
        pass
    message = str(caught.value)
    assert "killed by SIGILL (Illegal instruction)" in message and "tinygemm_kernel_amx" in message
    assert "\n" not in message


def test_a_server_that_never_answers_health_times_out_with_its_log(tmp_path):
    from phasekv.engines.process import EngineDied, launched

    with pytest.raises(EngineDied, match=r"not healthy after 1 s: still loading"), launched(
            ["sh", "-c", "echo still loading; sleep 30"], "http://127.0.0.1:9", name="slow", startup_s=1):
        pass


def test_a_missing_binary_is_one_line():
    from phasekv.engines.process import EngineDied, launched

    with pytest.raises(EngineDied, match="could not be started: No such file"), launched(
            ["/nonexistent/llama-server"], "http://127.0.0.1:9", name="llama-server"):
        pass
