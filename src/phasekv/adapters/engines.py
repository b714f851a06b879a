"""The engine APIs phasekv reaches a served model through: one class per API, and the HTTP connection they share.

Every prompt is sent as its exact token ids (no text, no BOS added by the server) and the engine's greedy next
token and top-k log-probabilities are read back:

    llamacpp  POST /completion       {"prompt": ids, "n_predict": 1, "n_probs": k, "cache_prompt": ...}
    openai    POST /v1/completions   {"prompt": ids, "max_tokens": 1, "logprobs": k, "model": ...}
                                     (llama.cpp's own top-logprob ids, or vLLM's "token_id:N" tokens)
    sglang    POST /generate         {"input_ids": ids, "return_logprob": true, "top_logprobs_num": k}

A new engine API is one subclass of `Api` here (its `name`, `path`, `body`, `parse` and `identify`; for the
decode-step audit `generate_body` and `parse_steps`, several greedy tokens per request), listed in `APIS`:
`--api NAME` then reaches it, and the adapter (`phasekv.adapters.endpoint`) needs no change.

`Connection` retries connection errors (refused, reset, timed out, a body cut short) and 5xx answers with
exponential backoff; anything else is a one-line `EndpointError`.  Every read is bounded: an answer larger than
`MAX_ANSWER_BYTES` is refused as it streams in (an endless body never fills memory), each chunk must come within
the timeout and the whole answer within twice it; a redirect is refused (phasekv never follows one).  The parses read
token ids and log-probabilities strictly (an id is a JSON integer, a log-probability a JSON number);
`phasekv.adapters.answers` then checks each answer against its request and the tokenizer.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)

# the largest answer read from a server: a completion with its top-k is a few kB, llama.cpp's /props tens of kB
MAX_ANSWER_BYTES = 16 << 20


class EndpointError(ValueError):
    """An endpoint that cannot be reached or does not answer with a completion (one line)."""


@dataclass(frozen=True)
class Answer:
    token: int  # the engine's greedy next token
    top: list[tuple[int, float]]  # the top-k (token id, log-probability), most likely first
    cached: int | None = None  # prompt tokens the engine reused from its prefix cache (None: not reported)


@dataclass(frozen=True)
class ServerInfo:
    model: str  # the served model's name (the id the openai API must be sent)
    vocab_size: int | None = None  # None: the server does not say
    context: int | None = None


# ---------------------------------------------------------------------------------------------- the wire


class Connection:
    """httpx client with timeouts and bounded retries (exponential backoff) on connection errors and 5xx."""

    def __init__(self, url: str, *, timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 concurrency: int = 1, transport: httpx.BaseTransport | None = None,
                 max_bytes: int = MAX_ANSWER_BYTES):
        check_url(url)
        check_timeout(timeout)
        self.url, self.retries, self.backoff, self.max_bytes = url.rstrip("/"), retries, backoff, max_bytes
        self.deadline_s = 2 * timeout  # the whole answer, however it trickles in
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                   limits=httpx.Limits(max_connections=concurrency + 1), transport=transport)

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        """The decoded JSON answer; EndpointError when unreachable after the retries, on a 3xx or 4xx, on an answer
        over `max_bytes`, or on non-JSON."""
        where = f"{self.url}{path}"
        for attempt in range(self.retries + 1):
            try:
                status, reason, headers, data = self._exchange(method, path, body, where)
            except httpx.TransportError as exc:  # refused, reset, timed out: the server may be (re)starting
                problem = f"cannot reach the server ({type(exc).__name__}: {_first_line(str(exc))})"
            else:
                if status < 500:
                    break
                problem = f"HTTP {status} ({_message(data, reason)})"
            if attempt == self.retries:
                raise EndpointError(f"{where}: {problem}, after {self.retries + 1} tries")
            log.info("%s: %s; retrying", where, problem)
            time.sleep(self.backoff * 2 ** attempt)
        if 300 <= status < 400:
            raise EndpointError(f"{where}: HTTP {status}, a redirect to {headers.get('location', '(nowhere)')!r}: "
                                "phasekv does not follow redirects; give the server's own URL as --endpoint")
        if status >= 400:
            raise EndpointError(f"{where}: HTTP {status} ({_message(data, reason)})")
        return _decode(data, where)

    def _exchange(self, method: str, path: str, body: dict | None, where: str) -> tuple[int, str, Any, bytes]:
        """(status, reason, headers, body) of one request, the body read at most `max_bytes` and within
        `deadline_s` (a trickle past it reads as a timeout, which is retried)."""
        deadline = time.monotonic() + self.deadline_s
        with self.client.stream(method, path, json=body) as response:
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > self.max_bytes:
                    raise EndpointError(f"{where}: answered more than {self.max_bytes >> 20} MiB (HTTP "
                                        f"{response.status_code}); an engine's answer is a few kB: is this the "
                                        "engine's URL?")
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"the answer took more than {self.deadline_s:g} s to arrive")
            return response.status_code, response.reason_phrase, response.headers, bytes(data)

    def get_optional(self, path: str) -> Any:
        """GET `path`, or None where the server has no such route (404)."""
        try:
            return self.request("GET", path)
        except EndpointError as exc:
            if "HTTP 404" in str(exc):
                return None
            raise

    def close(self) -> None:
        self.client.close()


def check_url(url: Any) -> None:
    """Refuse, in one line, an --endpoint that is not an http(s) URL naming a host (and a port in 1-65535)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise EndpointError(f"--endpoint {url}: must be an http:// or https:// URL")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError past 65535
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        raise EndpointError(f"--endpoint {url}: not a valid URL ({_first_line(str(exc))})") from None
    if not parts.hostname:
        raise EndpointError(f"--endpoint {url}: names no host")
    if port == 0:
        raise EndpointError(f"--endpoint {url}: port 0 is no server's port (1-65535)")


def check_timeout(timeout: Any) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            math.isfinite(timeout) and timeout > 0):
        raise EndpointError(f"--timeout: must be a finite number of seconds > 0, got {timeout}")


def _decode(data: bytes, where: str) -> Any:
    """The JSON of an answer's body (NaN and Infinity are read as numbers: the answer checks refuse them)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise EndpointError(f"{where}: answered JSON nested too deep to be a completion") from None
    except ValueError:  # UnicodeDecodeError included
        text = data[:400].decode("utf-8", errors="replace")
        raise EndpointError(f"{where}: answered non-JSON ({_first_line(text)[:120]!r})") from None


def _message(data: bytes, reason: str) -> str:
    """A server's error message: llama.cpp / OpenAI {"error": {"message"}}, FastAPI {"detail"}, else the text."""
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return _first_line(data[:400].decode("utf-8", errors="replace"))[:200] or reason
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail", payload.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return _first_line(str(error))[:200]
    return _first_line(json.dumps(payload))[:200]


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


# ---------------------------------------------------------------------------------------------- the APIs


class Api:
    """One engine API: the request body of a token-id prompt, the parse of its answer, the served model."""

    name: str
    path: str
    cache_switch = True  # the request can turn the engine's prompt cache on and off (--reuse-prefix)

    def body(self, ids: list[int], top_k: int, model: str, cache_prompt: bool) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, payload: Any) -> tuple[Answer, int | None]:
        """(the answer, the number of prompt tokens the engine read, None where it does not say)."""
        raise NotImplementedError

    def identify(self, conn: Connection, model: str | None) -> ServerInfo:
        raise NotImplementedError

    def generate_body(self, ids: list[int], steps: int, top_k: int, model: str) -> dict[str, Any]:
        """A request for `steps` greedy tokens after `ids` (end of sequence ignored), no prompt cache."""
        raise NotImplementedError

    def parse_steps(self, payload: Any) -> list[Answer]:
        """The answer of `generate_body`: one Answer per generated token, in order."""
        raise NotImplementedError


def _not_completion(api: str, payload: Any) -> EndpointError:
    return EndpointError(f"the server did not answer with a {api} completion: {json.dumps(payload)[:160]}")


def _ranked(top: list[tuple[Any, Any]]) -> list[tuple[int, float]]:
    return sorted(((_id(i), _logprob(lp)) for i, lp in top), key=lambda t: -t[1])


def _id(value: Any) -> int:
    """A token id as the answer gave it: a JSON integer (not a string, a float or a boolean)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"token id {value!r} is not an integer")
    return value


def _logprob(value: Any) -> float:
    """A log-probability as the answer gave it: a JSON number (its value is checked in `answers`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"log-probability {value!r} is not a number")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ValueError(f"log-probability {value} is out of range") from None


def _served_models(conn: Connection) -> list[dict[str, Any]]:
    listing = conn.get_optional("/v1/models")
    return listing.get("data", []) if isinstance(listing, dict) else []


def _pick_model(served: list[dict[str, Any]], model: str | None, where: str) -> dict[str, Any]:
    """The entry of /v1/models for `model` (the only one served, when not given)."""
    ids = [m.get("id") for m in served]
    if model is None:
        if len(served) != 1:
            raise EndpointError(f"{where}: serves {len(served)} models {ids}: choose one with --model")
        return served[0]
    for entry in served:
        if entry.get("id") == model:
            return entry
    raise EndpointError(f"--model {model}: not served by {where} (it serves {ids})")


class LlamaCppApi(Api):
    """llama.cpp's native /completion: an id array is used verbatim (no BOS added)."""

    name, path = "llamacpp", "/completion"

    def body(self, ids, top_k, model, cache_prompt):
        return {"prompt": ids, "n_predict": 1, "n_probs": top_k, "temperature": -1, "cache_prompt": cache_prompt}

    def parse(self, payload):
        try:
            step = payload["completion_probabilities"][0]
            top = [(p["id"], p["logprob"]) for p in step["top_logprobs"]]
            # timings.cache_n: prompt tokens reused from the slot (tokens_cached counts the slot after the request)
            answer = Answer(_id(step["id"]), _ranked(top), (payload.get("timings") or {}).get("cache_n"))
            read = payload.get("tokens_evaluated")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise _not_completion(self.name, payload) from None
        return answer, read

    def identify(self, conn, model):
        props = conn.get_optional("/props")
        if not isinstance(props, dict) or "model_path" not in props:
            raise EndpointError(f"{conn.url}/props: not a llama.cpp server (no model_path); is --api right?")
        name = Path(props["model_path"]).name
        served = _served_models(conn)
        if model is not None and model != name and model not in [m.get("id") for m in served]:
            raise EndpointError(f"--model {model}: {conn.url} serves {name}")
        meta = (served[0].get("meta") or {}) if served else {}
        context = (props.get("default_generation_settings") or {}).get("n_ctx")
        return ServerInfo(model or name, meta.get("n_vocab"), context)

    def generate_body(self, ids, steps, top_k, model):
        return {**self.body(ids, top_k, model, False), "n_predict": steps, "ignore_eos": True}

    def parse_steps(self, payload):
        try:
            return [Answer(int(step["id"]), _ranked([(p["id"], p["logprob"]) for p in step["top_logprobs"]]))
                    for step in payload["completion_probabilities"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise _not_completion(self.name, payload) from None


class OpenAIApi(Api):
    """OpenAI-style /v1/completions with a token-id prompt (llama.cpp, vLLM)."""

    name, path = "openai", "/v1/completions"

    def body(self, ids, top_k, model, cache_prompt):
        # cache_prompt is llama.cpp's switch, return_tokens_as_token_ids vLLM's "token_id:N" tokens; each
        # engine ignores the other's field
        return {"model": model, "prompt": ids, "max_tokens": 1, "logprobs": top_k, "temperature": 0,
                "cache_prompt": cache_prompt, "return_tokens_as_token_ids": True}

    def parse(self, payload):
        try:
            logprobs = payload["choices"][0]["logprobs"]
            usage = payload.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            read = usage.get("prompt_tokens")
            if "content" in logprobs:  # llama.cpp: ids alongside the text
                step = logprobs["content"][0]
                top = [(p["id"], p["logprob"]) for p in step["top_logprobs"]]
                return Answer(_id(step["id"]), _ranked(top), cached), read
            token = _token_id(logprobs["tokens"][0])  # OpenAI/vLLM: tokens as strings
            top = [(_token_id(t), lp) for t, lp in logprobs["top_logprobs"][0].items()]
            return Answer(token, _ranked(top), cached), read
        except EndpointError:
            raise
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise _not_completion(self.name, payload) from None

    def identify(self, conn, model):
        served = _served_models(conn)
        if not served:
            raise EndpointError(f"{conn.url}/v1/models: lists no model; is --api right?")
        entry = _pick_model(served, model, conn.url)
        meta = entry.get("meta") or {}  # llama.cpp
        return ServerInfo(entry["id"], meta.get("n_vocab"), entry.get("max_model_len") or meta.get("n_ctx_train"))

    def generate_body(self, ids, steps, top_k, model):
        # ignore_eos: llama.cpp's and vLLM's extension (each ignores what it does not know)
        return {**self.body(ids, top_k, model, False), "max_tokens": steps, "ignore_eos": True}

    def parse_steps(self, payload):
        try:
            logprobs = payload["choices"][0]["logprobs"]
            if "content" in logprobs:  # llama.cpp
                return [Answer(int(step["id"]), _ranked([(p["id"], p["logprob"]) for p in step["top_logprobs"]]))
                        for step in logprobs["content"]]
            return [Answer(_token_id(token), _ranked([(_token_id(t), lp) for t, lp in top.items()]))
                    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)]
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            raise _not_completion(self.name, payload) from None


def vllm_cache_config(conn: Connection) -> dict[str, str] | None:
    """vLLM's own account of its KV cache: the labels of the `vllm:cache_config_info` gauge in its Prometheus
    /metrics (enable_prefix_caching, cache_dtype, block_size, ...); None for a server without it (llama.cpp)."""
    try:
        response = conn.client.get("/metrics")
    except httpx.TransportError:
        return None
    if response.status_code != 200:
        return None
    for line in response.text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
    return None


def _token_id(token: str) -> int:
    """vLLM's "token_id:N" (return_tokens_as_token_ids); a plain text token cannot be mapped back exactly."""
    if not (isinstance(token, str) and token.startswith("token_id:")):
        raise EndpointError(f"the server answered the token as text ({token!r}), not as an id: phasekv needs ids "
                            "(vLLM: return_tokens_as_token_ids; llama.cpp: --api llamacpp)")
    digits = token[len("token_id:"):]
    if not (digits.isascii() and digits.isdigit()):  # no sign, space or underscore that int() would accept
        raise ValueError(f"token {token!r} is not token_id:N")
    return int(digits)


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
            token = _id(meta["output_token_logprobs"][0][1])
            top = [(t[1], t[0]) for t in meta["output_top_logprobs"][0]]
            answer = Answer(token, _ranked(top), meta.get("cached_tokens"))
            read = meta.get("prompt_tokens")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise _not_completion(self.name, payload) from None
        return answer, read

    def identify(self, conn, model):
        info = conn.get_optional("/get_model_info")
        if not isinstance(info, dict) or "model_path" not in info:
            raise EndpointError(f"{conn.url}/get_model_info: not an SGLang server (no model_path); is --api right?")
        if model is not None and model not in (info["model_path"], Path(info["model_path"]).name):
            raise EndpointError(f"--model {model}: {conn.url} serves {info['model_path']}")
        return ServerInfo(model or Path(info["model_path"]).name)

    def generate_body(self, ids, steps, top_k, model):
        body = self.body(ids, top_k, model, False)
        body["sampling_params"] = {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}
        return body

    def parse_steps(self, payload):
        try:
            meta = payload["meta_info"]
            return [Answer(int(token[1]), _ranked([(t[1], t[0]) for t in top]))
                    for token, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True)]
        except (KeyError, IndexError, TypeError, ValueError):
            raise _not_completion(self.name, payload) from None


APIS: dict[str, Api] = {api.name: api for api in (LlamaCppApi(), OpenAIApi(), SGLangApi())}
