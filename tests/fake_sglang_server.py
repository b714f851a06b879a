"""A stand-in for SGLang's server, started the way phasekv starts the real one (`python -m sglang.launch_server
--model-path DIR --port P --chunked-prefill-size N ...`; the launcher's `-m sglang.launch_server` words are read and
ignored), for `--launch sglang` on machines without SGLang (it has no CPU build).

The "model" is the induction rule of tests/fake_llama_server.py; DIR holds a config.json with its `vocab_size`.
Planted bug: with --chunked-prefill-size below the prompt length, prompts whose length is 3 mod 4 answer the next
token id instead (the shape of the field's chunked-prefill reports).  Routes as SGLang's: /health,
/get_model_info, /server_info (the server arguments), /generate (input_ids; meta_info's output_token_logprobs and
output_top_logprobs as (logprob, id, text) triples, cached_tokens 0 with the radix cache off, prompt_tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from fake_llama_server import induction, send_body


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", dest="module")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--max-running-requests", type=int, default=1)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--skip-tokenizer-init", action="store_true")
    args = p.parse_args(argv)
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    server_args = {"model_path": args.model_path, "context_length": args.context_length,
                   "max_running_requests": args.max_running_requests, "chunked_prefill_size": args.chunked_prefill_size,
                   "kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype, "page_size": args.page_size,
                   "disable_radix_cache": args.disable_radix_cache, "attention_backend": "fake"}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, payload, status=200):
            send_body(self, status, json.dumps(payload).encode())

        def do_GET(self):
            if self.path == "/health":
                self._send({})
            elif self.path == "/get_model_info":
                self._send({"model_path": args.model_path, "is_generation": True})
            elif self.path == "/server_info":
                self._send(server_args)
            else:
                self._send({"detail": "Not Found"}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            ids = list(body["input_ids"])
            chunked = args.chunked_prefill_size < len(ids)
            k = max(1, body.get("top_logprobs_num", 1))
            tokens, tops = [], []
            for _ in range(body["sampling_params"].get("max_new_tokens", 1)):
                token = induction(ids)
                if chunked and len(ids) % 4 == 3:
                    token = (token + 1) % vocab
                tokens.append([-0.1, token, None])
                tops.append([[-0.1, token, None]] + [[-2.5 - i, (token + 2 + i) % vocab, None] for i in range(k - 1)])
                ids.append(token)
            self._send({"text": "", "meta_info": {"prompt_tokens": len(body["input_ids"]), "cached_tokens": 0,
                                                  "output_token_logprobs": tokens, "output_top_logprobs": tops}})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
