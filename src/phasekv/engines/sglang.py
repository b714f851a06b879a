"""SGLang: its native /generate API, how phasekv starts its server, and what it says about its own settings.

    POST /generate   {"input_ids": ids, "return_logprob": true, "top_logprobs_num": k}
                     (meta_info's logprobs are (logprob, id, text) triples)

The radix (prefix) cache is a server setting, not a per-request switch, so `--reuse-prefix` has no meaning per request
and `LAUNCHER` (`--launch sglang`) starts the server with --disable-radix-cache unless the grid's radix_cache is "on"
(audited with --reuse-prefix, as vLLM's prefix_cache).  The command (the Python of SGLang's own environment, which
`PHASEKV_SGLANG` or ~/.cache/phasekv/sglang holds):

    python -m sglang.launch_server --model-path MODEL --host 127.0.0.1 --port P --context-length CONTEXT / SLOTS
           --max-running-requests SLOTS --skip-tokenizer-init, then: chunked_prefill_size --chunked-prefill-size,
           kv_cache_dtype --kv-cache-dtype, dtype --dtype, page_size --page-size, radix_cache on (a bare switch)

Its `report` is /server_info (older releases: /get_server_info): the server arguments a grid sets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phasekv.engines.base import Api, Launcher, Setting
from phasekv.engines.wire import Answer, Connection, EndpointError, ServerInfo, not_completion, ranked, strict_id


class SGLangApi(Api):
    """SGLang's native /generate with input_ids; meta_info's logprobs are (logprob, id, text) triples."""

    name, path = "sglang", "/generate"
    cache_switch = False

    def body(self, ids, top_k, model, cache_prompt):
        # SGLang's radix cache is a server setting (--disable-radix-cache), not a per-request switch
        return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True, "top_logprobs_num": top_k, "logprob_start_len": -1}

    def parse(self, payload):
        try:
            meta = payload["meta_info"]
            token = strict_id(meta["output_token_logprobs"][0][1])
            top = [(t[1], t[0]) for t in meta["output_top_logprobs"][0]]
            answer = Answer(token, ranked(top), meta.get("cached_tokens"))
            read = meta.get("prompt_tokens")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise not_completion(self.name, payload) from None
        return answer, read

    def identify(self, conn, model):
        info = conn.get_optional("/get_model_info")
        if not isinstance(info, dict) or "model_path" not in info:
            raise EndpointError(f"{conn.url}/get_model_info: not an SGLang server (no model_path); is --api right?")
        if model is not None and model not in (info["model_path"], Path(info["model_path"]).name):
            raise EndpointError(f"--model {model}: {conn.url} serves {info['model_path']}")
        context = info.get("max_total_num_tokens") if isinstance(info.get("max_total_num_tokens"), int) else None
        return ServerInfo(model or Path(info["model_path"]).name, None, context)

    def generate_body(self, ids, steps, top_k, model):
        body = self.body(ids, top_k, model, False)
        body["sampling_params"] = {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}
        return body

    def parse_steps(self, payload):
        try:
            meta = payload["meta_info"]
            return [Answer(int(token[1]), ranked([(t[1], t[0]) for t in top]))
                    for token, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True)]
        except (KeyError, IndexError, TypeError, ValueError):
            raise not_completion(self.name, payload) from None

    def report(self, conn):
        return sglang_report(conn)


# the server arguments of /server_info that a grid sets or that decide what a prompt's answer is computed with
_SERVER_ARGS = ("context_length", "max_running_requests", "chunked_prefill_size", "kv_cache_dtype", "dtype",
                "page_size", "disable_radix_cache", "attention_backend")


def sglang_report(conn: Connection) -> dict[str, Any]:
    """SGLang's own account of its settings: the server arguments of /server_info (/get_server_info before 0.4.4),
    None where neither route answers."""
    info = conn.get_optional("/server_info")
    if info is None:
        info = conn.get_optional("/get_server_info")
    if not isinstance(info, dict):
        return {"server_args": None}
    return {"server_args": {k: info.get(k) for k in _SERVER_ARGS if k in info}}


def _build(python: Path, model: Path, port: int, *, context: int, slots: int, flags: list[str]) -> list[str]:
    # context is the grid's total (llama.cpp splits it over its slots): SGLang's --context-length is per sequence
    return ["env", "OMP_NUM_THREADS=1", str(python), "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--context-length", str(context // slots),
            "--max-running-requests", str(slots), "--skip-tokenizer-init", *flags]


def _radix_cache(settings: dict[str, str]) -> bool:
    return settings.get("radix_cache") == "on"


API = SGLangApi()

LAUNCHER = Launcher(
    name="sglang", binary="venv/bin/python", api="sglang", build=_build, report=sglang_report,
    settings={"chunked_prefill_size": Setting(("--chunked-prefill-size",), low=1),
              "kv_cache_dtype": Setting(("--kv-cache-dtype",), ("auto", "fp8_e5m2", "fp8_e4m3")),
              "dtype": Setting(("--dtype",), ("auto", "float32", "bfloat16", "float16")),
              "page_size": Setting(("--page-size",), low=1),
              "radix_cache": Setting(switch={"off": ("--disable-radix-cache",), "on": ()})},
    defaults={"radix_cache": "off"},
    home=("PHASEKV_SGLANG", "sglang"), install="SGLang's server in its own environment (a GPU machine's)",
    startup_s=900.0, serves="folder", caches_prefix=_radix_cache,
    hints={"ubatch": "SGLang's prefill chunk is chunked_prefill_size", "batch": "use chunked_prefill_size",
           "max_num_batched_tokens": "SGLang's prefill chunk is chunked_prefill_size",
           "prefix_cache": "SGLang's prefix cache is radix_cache",
           "cache_type": "SGLang has one KV cache dtype for K and V: kv_cache_dtype",
           "threads": "phasekv runs SGLang with OMP_NUM_THREADS=1"})
