"""A stand-in for llama-server, started the way phasekv starts the real one (`-m MODEL --port P -ub N ...`): for the
engine grid's plumbing (launching, flags, resume, the table) on machines without the built engine.

The "model" is an induction rule (`induction`): the next token of a prompt is the one that followed the latest
earlier occurrence of the prompt's longest repeated suffix, which solves the lookup task exactly and copies a whole
multi-token value in greedy decoding.  MODEL is a JSON file {"n_vocab": V}.  Planted bugs, each answering the next
token id instead: with `-ub` below the prompt length, prompts whose length is 3 mod 4 (the shape of llama.cpp's
ubatch reports; `-ub` at least the prompt length is clean); with `-fa off`, a prompt whose prefix came from the
cache with a length of 1 mod 4; with `-ctk q8_0`, a prompt of length 0 mod 4 computed while another request was in
flight.  Routes: /health, /props, /slots (with `requests`: completions answered so far), /v1/models,
/completion (n_predict steps, n_probs top log-probabilities, timings.cache_n: the prompt tokens shared with the
previous request when cache_prompt is on; a positive logit_bias forces its token, whose log-probability is then
-0.1 where it is the rule's token and -3.0 elsewhere, as llama.cpp reports the raw probability of a forced token).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def send_body(handler: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
    """Answer a request of `handler` with `status` and the JSON bytes `data` (the stand-ins' one way to reply)."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def induction(ids: list[int], longest: int = 8) -> int:
    """The token after the latest earlier occurrence of the longest suffix (up to `longest` tokens) seen before."""
    for n in range(min(longest, len(ids) - 1), 0, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n]
    return ids[-1]


def answer(ids: list[int], args, vocab: int, *, cached: int = 0, batched: bool = False) -> int:
    """The induction token, or the next id where a planted bug applies (module docstring)."""
    token = induction(ids)
    ubatch_bug = args.ub < len(ids) and len(ids) % 4 == 3
    prefix_bug = args.fa == "off" and cached % 4 == 1
    batch_bug = args.ctk == "q8_0" and batched and len(ids) % 4 == 0
    return (token + 1) % vocab if ubatch_bug or prefix_bug or batch_bug else token


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("-ub", type=int, default=512)
    p.add_argument("-b", type=int, default=2048)
    p.add_argument("-c", type=int, default=4096)
    p.add_argument("-np", type=int, default=1)
    p.add_argument("-t", type=int, default=1)
    p.add_argument("-ctk", default="f16")
    p.add_argument("-ctv", default="f16")
    p.add_argument("-fa", default="auto")
    p.add_argument("--no-webui", action="store_true")
    args = p.parse_args(argv)
    with open(args.m) as f:
        vocab = json.load(f)["n_vocab"]
    last: list[int] = []
    served = [0]  # completion requests answered (its /slots reports it, for tests that no prompt was sent)
    active: list[list[bool]] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, payload, status=200):
            send_body(self, status, json.dumps(payload).encode())

        def do_GET(self):
            if self.path == "/health":
                self._send({"status": "ok"})
            elif self.path == "/props":
                self._send({"model_path": args.m, "total_slots": args.np, "build_info": "fake",
                            "chat_template": "x" * 100, "default_generation_settings": {"n_ctx": args.c}})
            elif self.path == "/slots":
                self._send([{"id": i, "n_ctx": args.c // args.np, "speculative": False, "params": {"n_predict": -1},
                             "requests": served[0]} for i in range(args.np)])
            elif self.path == "/v1/models":
                self._send({"data": [{"id": args.m, "meta": {"n_vocab": vocab, "n_ctx_train": args.c}}]})
            else:
                self._send({"error": {"message": "not found"}}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            prompt = list(body["prompt"])
            with lock:
                served[0] += 1
                shared = 0
                if body.get("cache_prompt"):
                    while shared < min(len(last), len(prompt)) and last[shared] == prompt[shared]:
                        shared += 1
                last[:] = prompt
                mine = [bool(active)]  # batched: another request was in flight at some point of this one's life
                for other in active:
                    other[0] = True
                active.append(mine)
            time.sleep(0.05)  # requests sent together overlap here
            batched = mine[0]
            ids, steps = list(prompt), []
            for _ in range(body.get("n_predict", 1)):
                token = answer(ids, args, vocab, cached=shared if len(ids) == len(prompt) else 0, batched=batched)
                k = max(1, body.get("n_probs", 1))  # as many top entries as asked, distinct ids, falling log-probs
                top = [{"id": token, "logprob": -0.1}] + [{"id": (token + 2 + i) % vocab, "logprob": -2.5 - i}
                                                          for i in range(k - 1)]
                forced = [t for t, bias in body.get("logit_bias", []) if bias > 0]  # the pick, not the numbers
                picked = forced[0] if forced else token
                steps.append({"id": picked, "logprob": -0.1 if picked == token else -3.0, "top_logprobs": top})
                ids.append(picked)
            with lock:
                active[:] = [a for a in active if a is not mine]
            self._send({"model": args.m, "tokens_evaluated": len(prompt), "timings": {"cache_n": shared},
                        "completion_probabilities": steps, "tokens": [s["id"] for s in steps]})

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
