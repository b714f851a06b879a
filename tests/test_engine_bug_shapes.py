"""Engine bugs keyed to the prompt length, planted by a small proxy in front of the stand-in llama-server
(tests/fake_llama_server.py, clean: its ubatch covers every prompt), read by the query protocol end to end: the
EndpointAdapter, `evaluate` and the query phase's verdict.  The three shapes the field reports, each with the
verdict it must get: a length-mod-4 bug is "phase sensitive: period 4"; errors growing linearly with the length
and "everything from length L on is wrong" are length effects, never a phase (phasekv.evaluate.query_stats)."""

import json
import threading
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from phasekv.data import Vocabulary, build_eval_set
from phasekv.evaluate.runner import evaluate
from tests.fake_llama_server import send_body
from tests.test_engine_grid import LLAMA, fake_engine

VOCAB = Vocabulary()
STRIDE, R = 4, 12


def query_set():
    # R = 3 S: the lengths span (R + S - 1) / S cycles; 8 clusters: every length offset 0..3 twice per family
    return build_eval_set(VOCAB, "query", n_records=24, n_demos=2, stride=STRIDE, residue_modulus=R, n_clusters=8,
                          local_window=4)


LENGTHS = sorted({len(p.ids) for p in query_set().prompts()})
SHAPES = {  # prompt token ids -> whether the engine answers wrong
    "mod4": lambda ids: len(ids) % 4 == 3,
    "threshold": lambda ids: len(ids) >= LENGTHS[len(LENGTHS) // 2 + 1],
    "linear": lambda ids: zlib.crc32(json.dumps(ids).encode()) % 1000
    < 1000 * 0.8 * (len(ids) - LENGTHS[0]) / (LENGTHS[-1] - LENGTHS[0]),
}


def proxy(upstream: str, wrong):
    """A loopback HTTP proxy to `upstream` that replaces the answer of a /completion whose prompt `wrong` picks by
    the next token id (the shape of a llama.cpp wrong-answer bug); returns (url, server)."""
    class Handler(BaseHTTPRequestHandler):
        def _forward(self, body=None):
            request = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()

        def _send(self, status, data):
            send_body(self, status, data)

        def do_GET(self):
            self._send(*self._forward())

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, data = self._forward(body)
            if self.path == "/completion" and wrong(list(json.loads(body)["prompt"])):
                reply = json.loads(data)
                for step in reply["completion_probabilities"]:
                    step["id"] = (step["id"] + 1) % VOCAB.size
                    step["top_logprobs"][0]["id"] = step["id"]
                reply["tokens"] = [s["id"] for s in reply["completion_probabilities"]]
                data = json.dumps(reply).encode()
            self._send(status, data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from phasekv.engines.registry import started

    binary, model = fake_engine(tmp_path_factory.mktemp("engine"), VOCAB.size)
    with started(LLAMA, binary, model, {"ubatch": "4096"}, context=4096) as url:
        yield url


def query_verdict(engine, shape, tmp_path):
    from phasekv.engines.client import EndpointAdapter

    url, server = proxy(engine, SHAPES[shape])
    adapter = EndpointAdapter(url, "llamacpp", VOCAB.size, concurrency=4)
    try:
        return evaluate(adapter, query_set(), tmp_path, progress=False, n_boot=300)["query_phase"]
    finally:
        adapter.close()
        server.shutdown()


def test_a_length_mod_4_bug_is_phase_sensitive_with_period_4(engine, tmp_path):
    query = query_verdict(engine, "mod4", tmp_path)
    assert query["verdict"].startswith("phase sensitive: period 4"), query["verdict"]
    assert [r["accuracy"] for r in query["per_phase"]].count(0.0) == 1


@pytest.mark.parametrize("shape", ["threshold", "linear"])
def test_a_length_keyed_bug_is_no_phase_and_its_length_effect_is_reported(engine, shape, tmp_path):
    query = query_verdict(engine, shape, tmp_path)
    assert not query["verdict"].startswith(("phase sensitive", "a phase effect", "a small phase effect")), (
        query["verdict"])
    trend = query["length_trend"]
    assert trend["ci_pp"][1] < 0 and f"accuracy changes by {trend['pp_per_stride']:+.1f} pp per 4 tokens" in (
        query["verdict"])
