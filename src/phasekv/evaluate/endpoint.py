"""A model as an inference engine serves it (llama.cpp, vLLM, SGLang), behind the evaluation adapter.

The compressed models people ship run in engines with their own compressed-attention kernels, so the
audit must reach the model through the engine's HTTP API.  Every prompt is sent as its exact token ids
(no text, no BOS added by the server: the answer's prompt-token count is checked), one prompt per
request, and the engine's greedy next token and top-k log-probabilities are read back.  Three APIs:

    llamacpp  POST /completion       {"prompt": ids, "n_predict": 1, "n_probs": k, "cache_prompt": ...}
    openai    POST /v1/completions   {"prompt": ids, "max_tokens": 1, "logprobs": k, "model": ...}
                                     (llama.cpp's own top-logprob ids, or vLLM's "token_id:N" tokens)
    sglang    POST /generate         {"input_ids": ids, "return_logprob": true, "top_logprobs_num": k}

`EndpointAdapter` implements the adapter interface (`phasekv.evaluate.adapter`) for `predict`: the
"cache" of a context is its ids, each query is sent as context + key, and the logits handed back are
the top-k log-probabilities with every other token at `FLOOR` (their argmax is the engine's greedy
token).  Prompt caching is off by default (each prompt is computed from scratch, as the in-process
reference computes it); `reuse_prefix` sends the queries of one context back to back with caching on,
so the engine's prefix cache serves them: for a compressed engine that is its own code path, and the
adapter's name says so.  Requests run `concurrency` at a time; connection errors (refused, reset, timed out, a
body cut short) and 5xx answers are retried with exponential backoff; anything else is a one-line `EndpointError`,
as is an answer that names another model than the run's first answer did (a server restarted mid-run).

Each answer is appended to a `Journal` (one fsync'd JSON line per prompt) as it arrives, so a killed
audit resumed with the same journal sends only the prompts that were never answered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from phasekv.evaluate.adapter import Adapter, ModelInfo

log = logging.getLogger(__name__)

FLOOR = -1e9  # the logit handed back for every token outside the engine's top-k (finite: `_top1` checks)
JOURNAL_VERSION = 1


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

    def __init__(self, url: str, timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 concurrency: int = 1, transport: httpx.BaseTransport | None = None):
        if not url.startswith(("http://", "https://")):
            raise EndpointError(f"--endpoint {url}: must be an http:// or https:// URL")
        self.url, self.retries, self.backoff = url.rstrip("/"), retries, backoff
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                   limits=httpx.Limits(max_connections=concurrency + 1), transport=transport)

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        """The decoded JSON answer; EndpointError when unreachable after the retries, on a 4xx, or on non-JSON."""
        where = f"{self.url}{path}"
        for attempt in range(self.retries + 1):
            try:
                response = self.client.request(method, path, json=body)
            except httpx.TransportError as exc:  # refused, reset, timed out: the server may be (re)starting
                problem = f"cannot reach the server ({type(exc).__name__}: {_first_line(str(exc))})"
            else:
                if response.status_code < 500:
                    break
                problem = f"HTTP {response.status_code} ({_message(response)})"
            if attempt == self.retries:
                raise EndpointError(f"{where}: {problem}, after {self.retries + 1} tries")
            log.info("%s: %s; retrying", where, problem)
            time.sleep(self.backoff * 2 ** attempt)
        if response.status_code >= 400:
            raise EndpointError(f"{where}: HTTP {response.status_code} ({_message(response)})")
        try:
            return response.json()
        except ValueError:
            raise EndpointError(f"{where}: answered non-JSON ({_first_line(response.text)[:120]!r})") from None

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


def _message(response: httpx.Response) -> str:
    """A server's error message: llama.cpp / OpenAI {"error": {"message"}}, FastAPI {"detail"}, else the text."""
    try:
        payload = response.json()
    except ValueError:
        return _first_line(response.text)[:200] or response.reason_phrase
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

    def body(self, ids: list[int], top_k: int, model: str, cache_prompt: bool) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, payload: Any) -> tuple[Answer, int | None]:
        """(the answer, the number of prompt tokens the engine read, None where it does not say)."""
        raise NotImplementedError

    def identify(self, conn: Connection, model: str | None) -> ServerInfo:
        raise NotImplementedError


def _not_completion(api: str, payload: Any) -> EndpointError:
    return EndpointError(f"the server did not answer with a {api} completion: {json.dumps(payload)[:160]}")


def _ranked(top: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return sorted(((int(i), float(lp)) for i, lp in top), key=lambda t: -t[1])


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
            answer = Answer(int(step["id"]), _ranked(top), (payload.get("timings") or {}).get("cache_n"))
            read = payload.get("tokens_evaluated")
        except (KeyError, IndexError, TypeError, ValueError):
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
                return Answer(int(step["id"]), _ranked(top), cached), read
            token = _token_id(logprobs["tokens"][0])  # OpenAI/vLLM: tokens as strings
            top = [(_token_id(t), lp) for t, lp in logprobs["top_logprobs"][0].items()]
        except (KeyError, IndexError, TypeError, AttributeError):
            raise _not_completion(self.name, payload) from None
        return Answer(token, _ranked(top), cached), read

    def identify(self, conn, model):
        served = _served_models(conn)
        if not served:
            raise EndpointError(f"{conn.url}/v1/models: lists no model; is --api right?")
        entry = _pick_model(served, model, conn.url)
        meta = entry.get("meta") or {}  # llama.cpp
        return ServerInfo(entry["id"], meta.get("n_vocab"), entry.get("max_model_len") or meta.get("n_ctx_train"))


def _token_id(token: str) -> int:
    """vLLM's "token_id:N" (return_tokens_as_token_ids); a plain text token cannot be mapped back exactly."""
    if not (isinstance(token, str) and token.startswith("token_id:")):
        raise EndpointError(f"the server answered the token as text ({token!r}), not as an id: phasekv needs ids "
                            "(vLLM: return_tokens_as_token_ids; llama.cpp: --api llamacpp)")
    return int(token[len("token_id:"):])


class SGLangApi(Api):
    """SGLang's native /generate with input_ids; meta_info's logprobs are (logprob, id, text) triples."""

    name, path = "sglang", "/generate"

    def body(self, ids, top_k, model, cache_prompt):
        # SGLang's radix cache is a server setting (--disable-radix-cache), not a per-request switch
        return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True, "top_logprobs_num": top_k, "logprob_start_len": -1}

    def parse(self, payload):
        try:
            meta = payload["meta_info"]
            token = int(meta["output_token_logprobs"][0][1])
            top = [(t[1], t[0]) for t in meta["output_top_logprobs"][0]]
            answer = Answer(token, _ranked(top), meta.get("cached_tokens"))
            read = meta.get("prompt_tokens")
        except (KeyError, IndexError, TypeError, ValueError):
            raise _not_completion(self.name, payload) from None
        return answer, read

    def identify(self, conn, model):
        info = conn.get_optional("/get_model_info")
        if not isinstance(info, dict) or "model_path" not in info:
            raise EndpointError(f"{conn.url}/get_model_info: not an SGLang server (no model_path); is --api right?")
        if model is not None and model not in (info["model_path"], Path(info["model_path"]).name):
            raise EndpointError(f"--model {model}: {conn.url} serves {info['model_path']}")
        return ServerInfo(model or Path(info["model_path"]).name)


APIS: dict[str, Api] = {api.name: api for api in (LlamaCppApi(), OpenAIApi(), SGLangApi())}


# ---------------------------------------------------------------------------------------------- the journal


def prompt_key(ids: list[int]) -> str:
    """A prompt's journal key: a hash of its exact token ids."""
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()[:32]


class Journal:
    """Answers appended as they arrive, one fsync'd JSON line each, after a header line of the settings.

    A run killed mid-line leaves a torn last line: it is cut off when the journal is reopened.  A journal
    is continued only with `resume` and only for the same settings; `fresh` discards an old one."""

    def __init__(self, path: str | Path, settings: dict[str, Any], resume: bool = False, fresh: bool = False):
        self.path, self.settings = Path(path), settings
        self.answers: dict[str, Answer] = {}
        self._lock = threading.Lock()
        if self.path.exists() and not fresh:
            if not resume:
                raise EndpointError(f"{self.path}: the journal of an interrupted run exists: pass --resume to "
                                    "continue it (only unanswered prompts are sent) or --force to start over")
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            self._append({"journal": JOURNAL_VERSION, **settings})
        self.resumed = len(self.answers)

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]  # a torn last line is an answer that never arrived
        if len(complete) < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
        lines = complete.decode().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except ValueError:
            header = {}
        if header.get("journal") != JOURNAL_VERSION:
            raise EndpointError(f"{self.path}: not a phasekv endpoint journal; remove it or use --force")
        stored = {k: v for k, v in header.items() if k != "journal"}
        if stored != self.settings:
            diff = {k: (stored.get(k), v) for k, v in self.settings.items() if stored.get(k) != v}
            raise EndpointError(f"{self.path}: written with other settings (journal, now: {diff}); --resume needs "
                                "the same ones, or use --force to start over")
        for line in lines[1:]:
            entry = json.loads(line)
            self.answers[entry["key"]] = Answer(entry["token"], [tuple(t) for t in entry["top"]], entry["cached"])

    def _append(self, entry: dict[str, Any]) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def add(self, key: str, answer: Answer) -> None:
        self.answers[key] = answer
        self._append({"key": key, **asdict(answer)})


# ---------------------------------------------------------------------------------------------- the adapter


def check_options(api: str, concurrency: int, top_k: int = 1) -> None:
    if api not in APIS:
        raise EndpointError(f"--api: must be one of {list(APIS)}, got {api!r}")
    if concurrency < 1:
        raise EndpointError(f"--concurrency: must be >= 1, got {concurrency}")
    if top_k < 1:
        raise EndpointError(f"top_k: must be >= 1, got {top_k}")


class EndpointAdapter(Adapter):
    """The adapter of a served model (see the module docstring).  `vocab_size`: the tokenizer's, checked
    against the server's where it reports one."""

    shares_cache = False  # a context's queries are separate requests: keep about batch_size prompts per call

    def __init__(self, url: str, api: str, vocab_size: int, model: str | None = None, top_k: int = 8,
                 concurrency: int = 1, reuse_prefix: bool = False, timeout: float = 600.0, retries: int = 3,
                 backoff: float = 0.5, transport: httpx.BaseTransport | None = None):
        check_options(api, concurrency, top_k)
        self.api, self.top_k, self.concurrency, self.reuse_prefix = APIS[api], top_k, concurrency, reuse_prefix
        self.conn = Connection(url, timeout, retries, backoff, concurrency, transport)
        server = self.api.identify(self.conn, model)
        if server.vocab_size is not None and server.vocab_size != vocab_size:
            raise EndpointError(f"{url} serves {server.model} with a vocabulary of {server.vocab_size} tokens, the "
                                f"tokenizer has {vocab_size}: wrong --tokenizer or wrong model")
        self.model = server.model
        mode = "reuse-prefix" if reuse_prefix else "no prompt cache"
        self.info = ModelInfo(f"{server.model} via {api} ({mode})", vocab_size, 0, 0, 0, 0,
                              server.context or 1 << 30, None, None)
        self.module, self.device = None, torch.device("cpu")
        self.journal: Journal | None = None
        self.answers: dict[str, Answer] = {}
        self.sent = 0  # requests answered by the server in this process (the journal's are not resent)
        self.answered_by: str | None = None  # the "model" the server's first answer named (llama.cpp, OpenAI, vLLM)
        self._lock = threading.Lock()

    def settings(self) -> dict[str, Any]:
        """What a journal must agree on to be resumed: the same server answers to the same requests."""
        return {"api": self.api.name, "model": self.model, "top_k": self.top_k, "reuse_prefix": self.reuse_prefix}

    def attach(self, journal: Journal) -> None:
        """Journal every answer from now on; the journal's answers are not asked again."""
        self.journal = journal
        self.answers.update(journal.answers)

    def attention_layers(self):
        raise ValueError("an endpoint exposes no attention modules: the probes need an in-process model "
                         "(--hf or --checkpoint)")

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> (B, 1, V): the next-token log-probabilities of each prompt (top-k; others FLOOR)."""
        return self._logits([[row] for row in ids.tolist()])

    def prefill(self, ids: torch.Tensor) -> list[list[int]]:
        return ids.tolist()  # nothing is computed ahead: each query carries its whole context

    def continue_from(self, cache: list[list[int]], ids: torch.Tensor, repeats: int) -> torch.Tensor:
        """ids (B * repeats, t) -> (B * repeats, 1, V), context-major: each context + each of its queries."""
        queries = ids.tolist()
        groups = [[context + queries[i * repeats + j] for j in range(repeats)] for i, context in enumerate(cache)]
        return self._logits(groups)

    def _logits(self, groups: list[list[list[int]]]) -> torch.Tensor:
        answers = [a for group in self.answer(groups) for a in group]
        out = torch.full((len(answers), 1, self.info.vocab_size), FLOOR)
        for row, answer in enumerate(answers):
            ids = torch.tensor([i for i, _ in answer.top], dtype=torch.long)
            if max(answer.token, *ids.tolist()) >= self.info.vocab_size:
                raise EndpointError(f"the server answered token id {max(answer.token, *ids.tolist())}, outside the "
                                    f"tokenizer's {self.info.vocab_size}: wrong --tokenizer")
            out[row, 0, ids] = torch.tensor([max(lp, FLOOR / 2) for _, lp in answer.top])
            if int(out[row, 0].argmax()) != answer.token:  # a tie in the top-k: the engine's own pick wins
                out[row, 0, answer.token] = out[row, 0].max() + 1e-4
        return out

    def answer(self, groups: list[list[list[int]]]) -> list[list[Answer]]:
        """The answers to prompt groups, in order.  Journaled prompts are not sent; the others are sent
        `concurrency` at a time: one group's prompts back to back in reuse-prefix mode, each on its own
        otherwise."""
        if not self.reuse_prefix:
            groups = [[prompt] for group in groups for prompt in group]
        keys = [[prompt_key(p) for p in group] for group in groups]
        todo = [g for g, group_keys in enumerate(keys) if any(k not in self.answers for k in group_keys)]
        if todo:
            # set by the first failure, in the thread that saw it: no request starts after it (a worker would
            # otherwise take the next queued prompt before the caller gets to cancel the queue)
            stop = threading.Event()

            def send(g: int) -> None:
                if stop.is_set():
                    return
                try:
                    self._send_group(groups[g], keys[g])
                except BaseException:
                    stop.set()
                    raise

            pool = ThreadPoolExecutor(self.concurrency)
            try:
                for future in as_completed([pool.submit(send, g) for g in todo]):
                    future.result()  # the first failure stops the run
            except BaseException:  # a failure or Ctrl-C: nothing more is sent; requests in flight finish (journaled)
                stop.set()
                raise
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        return [[self.answers[k] for k in group_keys] for group_keys in keys]

    def _send_group(self, prompts: list[list[int]], keys: list[str]) -> None:
        for ids, key in zip(prompts, keys, strict=True):
            if key in self.answers:
                continue
            payload = self.conn.request("POST", self.api.path, self.api.body(ids, self.top_k, self.model,
                                                                              self.reuse_prefix))
            answer, read = self.api.parse(payload)
            if read is not None and read != len(ids):
                raise EndpointError(f"the server read {read} prompt tokens where {len(ids)} ids were sent (did it "
                                    "add a BOS or tokenize the prompt as text?)")
            served = payload.get("model") if isinstance(payload, dict) else None
            with self._lock:  # the request threads count and store answers one at a time
                if isinstance(served, str):  # every answer must come from the model the first one came from
                    self.answered_by = self.answered_by or served
                    if served != self.answered_by:
                        raise EndpointError(f"the server answered with model {served!r} after {self.answered_by!r}: "
                                            "was it restarted with another model? (answers so far are journaled)")
                self.sent += 1
                self.answers[key] = answer
            if self.journal is not None:
                self.journal.add(key, answer)

    def close(self) -> None:
        self.conn.close()


def open_endpoint(url: str, api: str, tokenizer_dir: str, gguf_file: str | None = None, model: str | None = None,
                  concurrency: int = 1, reuse_prefix: bool = False, journal: str | Path | None = None,
                  resume: bool = False, fresh: bool = False, timeout: float = 600.0):
    """(EndpointAdapter, tokenizer) for `phasekv audit/eval --endpoint`: the tokenizer is read locally (the
    prompts are built as ids here), the server is checked to serve a model of that vocabulary, and answers
    go to `journal` (continued with `resume`, replaced with `fresh`)."""
    from phasekv.evaluate.hf import load_tokenizer

    check_options(api, concurrency)  # before the (slow) tokenizer
    tokenizer = load_tokenizer(tokenizer_dir, gguf_file, flag="--tokenizer")
    adapter = EndpointAdapter(url, api, len(tokenizer), model=model, concurrency=concurrency,
                              reuse_prefix=reuse_prefix, timeout=timeout)
    if journal is not None:
        adapter.attach(Journal(journal, adapter.settings(), resume=resume, fresh=fresh))
        log.info("journal %s: %d answers from an earlier run", journal, adapter.journal.resumed)
    return adapter, tokenizer


def check_endpoint_conditions(conditions: tuple[str, ...]) -> None:
    """An endpoint is audited as it serves: the post-hoc compressions need the cache of an in-process model."""
    other = [c for c in conditions if c != "none"]
    if other:
        raise EndpointError(f"--compress {' '.join(other)}: not available with --endpoint (the engine's own "
                            "compression is what is audited; phasekv cannot reach its cache): use --compress none")


def journal_path(out: str | Path) -> Path:
    """Where a run's journal lives until the run is published: beside OUT (a killed run leaves no OUT)."""
    out = Path(out)
    return out.with_name(out.name + ".journal.jsonl")


def keep_journal(adapter: EndpointAdapter, out: str | Path) -> None:
    """After OUT is published: OUT/endpoint.json (how the answers were obtained) and the journal moved into OUT
    as endpoint_journal.jsonl (every prompt's top-k log-probabilities)."""
    from phasekv.outputs import fsync_dir, write_atomic

    out = Path(out)
    cached = [a.cached for a in adapter.answers.values() if a.cached is not None]
    record = {**adapter.settings(), "endpoint": adapter.conn.url, "concurrency": adapter.concurrency,
              "prompt_cache": "reuse-prefix" if adapter.reuse_prefix else "off", "answers": len(adapter.answers),
              "requests_this_run": adapter.sent,
              "answers_from_journal": adapter.journal.resumed if adapter.journal else 0,
              "cached_prompt_tokens": sum(cached) if cached else None}
    write_atomic(out / "endpoint.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
    if adapter.journal is not None and adapter.journal.path.exists():
        os.replace(adapter.journal.path, out / "endpoint_journal.jsonl")
        fsync_dir(out)
        fsync_dir(adapter.journal.path.parent)
