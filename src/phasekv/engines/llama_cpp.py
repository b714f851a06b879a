"""llama.cpp's llama-server: its native API, how phasekv starts it, and what it says about its own settings.

    POST /completion   {"prompt": ids, "n_predict": 1, "n_probs": k, "cache_prompt": ...}  (ids used verbatim: no BOS)

`LAUNCHER` (`--launch llama-server`) builds

    llama-server   -m MODEL --host 127.0.0.1 --port P -c CONTEXT -np SLOTS --no-webui, then one flag per setting:
                   ubatch -ub, batch -b, cache_type_k -ctk, cache_type_v -ctv, cache_type -ctk and -ctv,
                   flash_attn -fa, threads -t
                   (and -t 1 when threads is not a grid key: phasekv's runs share the CPU cores)

and its `report` is /props (without the chat template) and /slots.  `llama_server` and `smoke` start a server for
the tests and for `make engine`, which requires the binary to load a model and answer one token before it counts as
installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from phasekv.engines.base import Api, Launcher, Setting
from phasekv.engines.process import EngineDied, free_port, launched
from phasekv.engines.wire import (
    Answer,
    Connection,
    EndpointError,
    ServerInfo,
    not_completion,
    ranked,
    scored_logprob,
    served_models,
    strict_id,
)

FORCE_BIAS = 1e4  # a logit bias no raw logit difference comes near: the biased token is the greedy pick


def llama_step(step: Any, cached: int | None = None, *, strict: bool = True) -> Answer:
    """One generated token as llama.cpp gives it, {"id", "top_logprobs": [{"id", "logprob"}, ...]} (in /completion's
    completion_probabilities and in /v1/completions' logprobs.content), as an Answer; `strict`: the id must be a JSON
    integer (the decode steps' ids are read with int())."""
    token = strict_id(step["id"]) if strict else int(step["id"])
    return Answer(token, ranked([(p["id"], p["logprob"]) for p in step["top_logprobs"]]), cached)


class LlamaCppApi(Api):
    """llama.cpp's native /completion: an id array is used verbatim (no BOS added)."""

    name, path = "llamacpp", "/completion"

    def body(self, ids, top_k, model, cache_prompt):
        return {"prompt": ids, "n_predict": 1, "n_probs": top_k, "temperature": -1, "cache_prompt": cache_prompt}

    def parse(self, payload):
        try:
            # timings.cache_n: prompt tokens reused from the slot (tokens_cached counts the slot after the request)
            answer = llama_step(payload["completion_probabilities"][0], (payload.get("timings") or {}).get("cache_n"))
            read = payload.get("tokens_evaluated")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise not_completion(self.name, payload) from None
        return answer, read

    scoring = ("llama.cpp: one request per continuation token, the token forced by logit_bias; the log-probability "
               "read is the engine's softmax of its raw logits (exact; below float32's range read as -9999)")

    def continuation_logprobs(self, conn, prompt, continuation, model, cache_prompt):
        """Teacher forcing one token per request: prompt + continuation[:j], n_predict 1, continuation[j] forced by
        `logit_bias`.  llama.cpp reports the sampled token's probability from the softmax of the raw logits (its
        README: with temperature < 0 "a simple softmax of the logits without considering any other sampler
        settings"), so the bias moves the pick, not the number."""
        out, cached = [], 0
        for j, token in enumerate(continuation):
            ids = [*prompt, *continuation[:j]]
            payload = conn.request("POST", self.path, {**self.body(ids, 1, model, cache_prompt),
                                                       "logit_bias": [[token, FORCE_BIAS]]})
            try:
                step = payload["completion_probabilities"][0]
                picked, read = strict_id(step["id"]), payload.get("tokens_evaluated")
                out.append(scored_logprob(step["logprob"], token))
                cached += int((payload.get("timings") or {}).get("cache_n") or 0)
            except (KeyError, IndexError, TypeError, ValueError, AttributeError):
                raise not_completion(self.name, payload) from None
            if picked != token:
                raise EndpointError(f"{conn.url}: logit_bias did not force token {token} (the server picked "
                                    f"{picked}): it cannot score a continuation this way")
            if read is not None and read != len(ids):
                raise EndpointError(f"{conn.url}: read {read} prompt tokens of the {len(ids)} sent (a BOS added, or "
                                    "a prompt cut?)")
        return out, cached

    def identify(self, conn, model):
        props = conn.get_optional("/props")
        if not isinstance(props, dict) or "model_path" not in props:
            raise EndpointError(f"{conn.url}/props: not a llama.cpp server (no model_path); is --api right?")
        name = Path(props["model_path"]).name
        served = served_models(conn)
        if model is not None and model != name and model not in [m.get("id") for m in served]:
            raise EndpointError(f"--model {model}: {conn.url} serves {name}")
        meta = (served[0].get("meta") or {}) if served else {}
        context = (props.get("default_generation_settings") or {}).get("n_ctx")
        return ServerInfo(model or name, meta.get("n_vocab"), context)

    def generate_body(self, ids, steps, top_k, model):
        return {**self.body(ids, top_k, model, False), "n_predict": steps, "ignore_eos": True}

    def parse_steps(self, payload):
        try:
            return [llama_step(step, strict=False) for step in payload["completion_probabilities"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise not_completion(self.name, payload) from None

    def report(self, conn):
        return llama_cpp_report(conn)


_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# /props fields that describe the server (the chat template is long text and says nothing about the numbers)
_PROPS_DROP = ("chat_template", "chat_template_tool_use", "chat_template_caps")


def llama_cpp_report(conn: Connection) -> dict[str, Any]:
    """llama.cpp's own account of its settings: /props (without the chat template) and, per slot, /slots' context
    and sampling parameters (None where the server has the route off)."""
    props = conn.get_optional("/props")
    slots = conn.get_optional("/slots")
    report: dict[str, Any] = {"props": {k: v for k, v in props.items() if k not in _PROPS_DROP}
                              if isinstance(props, dict) else None}
    report["slots"] = [{k: s.get(k) for k in ("id", "n_ctx", "speculative", "params") if k in s}
                       for s in slots if isinstance(s, dict)] if isinstance(slots, list) else None
    return report


def llama_server_command(binary: Path, model: Path, port: int, *, slots: int = 1, context: int = 4096,
                         threads: int | None = 1, extra: Sequence[str] = ()) -> list[str]:
    """llama.cpp's command line: `slots` parallel sequences sharing `context` tokens, on 127.0.0.1:`port`."""
    threads_flag = [] if threads is None else ["-t", str(threads)]  # None: a setting of the grid gives it
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *threads_flag,
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


def _build(binary: Path, model: Path, port: int, *, context: int, slots: int, flags: list[str]) -> list[str]:
    return llama_server_command(binary, model, port, slots=slots, context=context, threads=None, extra=flags)


API = LlamaCppApi()

LAUNCHER = Launcher(
    name="llama-server", binary="bin/llama-server", api="llamacpp", build=_build, report=llama_cpp_report,
    settings={"ubatch": Setting(("-ub",), low=1), "batch": Setting(("-b",), low=1),
              "cache_type_k": Setting(("-ctk",), _CACHE_TYPES), "cache_type_v": Setting(("-ctv",), _CACHE_TYPES),
              # both caches at once: DeepSeek-V4 in llama.cpp b11434 refuses different K and V cache types
              "cache_type": Setting(("-ctk", "-ctv"), _CACHE_TYPES),
              "flash_attn": Setting(("-fa",), ("on", "off", "auto")), "threads": Setting(("-t",), low=1)},
    defaults={"threads": "1"},
    hints={"max_num_batched_tokens": "llama.cpp's batch sizes are ubatch and batch",
           "kv_cache_dtype": "llama.cpp's are cache_type_k, cache_type_v and cache_type (both)",
           "prefix_cache": "llama.cpp's prompt cache is per request: --reuse-prefix, --engine-checks prefix"})
