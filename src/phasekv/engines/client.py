"""A model as an inference engine serves it (llama.cpp, vLLM, SGLang), behind the evaluation adapter.

The compressed models people ship run in engines with their own compressed-attention kernels, so the
audit must reach the model through the engine's HTTP API.  Every prompt is sent as its exact token ids
(no text, no BOS added by the server: the answer's prompt-token count is checked), one prompt per
request, and the engine's greedy next token and top-k log-probabilities are read back.  Three APIs
(one class each in `phasekv.engines.wire`):

    llamacpp  POST /completion       {"prompt": ids, "n_predict": 1, "n_probs": k, "cache_prompt": ...}
    openai    POST /v1/completions   {"prompt": ids, "max_tokens": 1, "logprobs": k, "model": ...}
                                     (llama.cpp's own top-logprob ids, or vLLM's "token_id:N" tokens)
    sglang    POST /generate         {"input_ids": ids, "return_logprob": true, "top_logprobs_num": k}

`EndpointAdapter` implements the adapter interface (`phasekv.adapters.base`) for `predict`: the
"cache" of a context is its ids, each query is sent as context + key, and the logits handed back are
the top-k log-probabilities with every other token at `FLOOR` (their argmax is the engine's greedy
token).  Prompt caching is off by default (each prompt is computed from scratch, as the in-process
reference computes it); `reuse_prefix` sends the queries of one context back to back with caching on,
so the engine's prefix cache serves them: for a compressed engine that is its own code path, and the
adapter's name says so.  Requests run `concurrency` at a time; connection errors (refused, reset, timed out, a
body cut short) and 5xx answers are retried with exponential backoff; anything else is a one-line `EndpointError`,
as is an answer that names another model than the run's first answer did (a server restarted mid-run).

With prompt caching off, a vLLM server whose /metrics says its prefix cache is on is refused before any request, and
so is an answer that says it reused cached prompt tokens: vLLM ignores the request's `cache_prompt` and caches
prefixes unless started with --no-enable-prefix-caching.  Where the server does not say
(vLLM without --enable-prompt-tokens-details), the run's endpoint.json records that the cache was not checked.

Each answer is appended to a `Journal` (`phasekv.engines.journal`: one fsync'd JSON line per prompt) as it
arrives, so a killed audit resumed with the same journal sends only the prompts that were never answered.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import torch

from phasekv.adapters.base import Adapter, ModelInfo
from phasekv.engines.answers import answer_problem, check_answer, check_server
from phasekv.engines.journal import Journal, journal_path, prompt_key
from phasekv.engines.registry import api as api_named
from phasekv.engines.wire import Answer, Connection, EndpointError, check_timeout, check_url

log = logging.getLogger(__name__)

FLOOR = -1e9  # the logit handed back for every token outside the engine's top-k (finite: `_top1` checks)


@dataclass(frozen=True)
class EndpointOptions:
    """How to reach a served model (the --endpoint flags of eval and audit)."""

    url: str
    replicas: tuple[str, ...] = ()  # more servers of the same model: requests are spread over all of them
    tokenizer: str | None = None  # the served model's tokenizer (a directory; with gguf_file, that file in it)
    api: str = "llamacpp"
    gguf_file: str | None = None
    model: str | None = None  # the served model's name (None: the one model the server serves)
    concurrency: int = 1
    reuse_prefix: bool = False
    timeout: float = 600.0
    resume: bool = False  # continue the journal of a killed run


def check_options(api: str, concurrency: int, top_k: int = 1) -> None:
    api_named(api)  # a one-line refusal naming the known APIs
    if concurrency < 1:
        raise EndpointError(f"--concurrency: must be >= 1, got {concurrency}")
    if top_k < 1:
        raise EndpointError(f"top_k: must be >= 1, got {top_k}")


def check_reuse_prefix(api: str, reuse_prefix: bool) -> None:
    if reuse_prefix and not api_named(api).cache_switch:
        raise EndpointError(f"--reuse-prefix: the {api} API has no per-request prompt-cache switch (SGLang's radix "
                            "cache is set when the server starts: --disable-radix-cache); drop --reuse-prefix")


def check_endpoint_options(options: EndpointOptions) -> None:
    """Every --endpoint flag, checked before anything is loaded or asked."""
    urls = (options.url, *options.replicas)
    for url in urls:
        check_url(url)
    repeated = sorted({u for u in urls if urls.count(u) > 1})
    if repeated:
        raise EndpointError(f"--endpoint {repeated[0]}: given twice (each server once; --concurrency sets the "
                            "requests in flight per server)")
    check_timeout(options.timeout)
    check_options(options.api, options.concurrency)
    check_reuse_prefix(options.api, options.reuse_prefix)


class EndpointAdapter(Adapter):
    """The adapter of a served model (see the module docstring).  `vocab_size`: the tokenizer's, checked
    against the server's where it reports one."""

    shares_cache = False  # a context's queries are separate requests: keep about batch_size prompts per call

    def __init__(self, url: str, api: str, vocab_size: int, *, model: str | None = None, top_k: int = 8,
                 concurrency: int = 1, reuse_prefix: bool = False, timeout: float = 600.0, retries: int = 3,
                 backoff: float = 0.5, transport: httpx.BaseTransport | None = None, replicas: tuple[str, ...] = ()):
        check_options(api, concurrency, top_k)
        check_reuse_prefix(api, reuse_prefix)
        self.api, self.top_k, self.concurrency, self.reuse_prefix = api_named(api), top_k, concurrency, reuse_prefix
        self.conns = [Connection(u, timeout=timeout, retries=retries, backoff=backoff, concurrency=concurrency,
                                 transport=transport) for u in (url, *replicas)]
        self.conn = self.conns[0]  # the one a server's settings and checks are read from
        server = self._identify_all(model)
        if server.vocab_size is not None and server.vocab_size != vocab_size:
            raise EndpointError(f"{url} serves {server.model} with a vocabulary of {server.vocab_size} tokens, the "
                                f"tokenizer has {vocab_size}: wrong --tokenizer or wrong model")
        self.model = server.model
        # a server may say that it caches prefixes whatever a request asks (vLLM): refused before any request
        self.cache_config, forced = self.api.server_cache(self.conn)
        for conn in self.conns[1:]:
            forced = forced or self.api.server_cache(conn)[1]
        if not reuse_prefix and forced:
            raise EndpointError(f"{url} runs vLLM with its prefix cache on (/metrics: enable_prefix_caching): a run "
                                "without prompt cache needs --no-enable-prefix-caching, or audit with --reuse-prefix")
        mode = "reuse-prefix" if reuse_prefix else "no prompt cache"
        # the answer is one generated token, which needs a place in the context too (vLLM refuses a prompt of
        # max_model_len tokens as "max_tokens must be at least 1, got 0")
        spread = f", {len(self.conns)} endpoints" if len(self.conns) > 1 else ""
        self.info = ModelInfo(name=f"{server.model} via {api} ({mode}{spread})", vocab_size=vocab_size, num_layers=0,
                              num_heads=0, num_kv_heads=0, head_dim=0,
                              max_length=server.context - 1 if server.context else 1 << 30, stride=None,
                              local_window=None)
        self.module, self.device = None, torch.device("cpu")
        self.journal: Journal | None = None
        self.answers: dict[str, Answer] = {}
        self.sent = 0  # requests answered by the server in this process (the journal's are not resent)
        self.answered_by: dict[str, str] = {}  # per server: the "model" its first answer named (llama.cpp, vLLM)
        self._lock = threading.Lock()
        self._free: queue.SimpleQueue[Connection] = queue.SimpleQueue()  # `concurrency` slots per server
        for _ in range(concurrency):
            for conn in self.conns:
                self._free.put(conn)

    def check_length(self, length: int) -> None:
        """Refuse, before any prompt is sent, prompts the server's context cannot hold with their answer token."""
        if length > self.info.max_length:
            raise EndpointError(f"{self.conn.url}: serves a context of {self.info.max_length + 1} tokens, the "
                                f"longest prompt needs {length} + 1 answer token: start the server with a larger "
                                "context or use shorter prompts")

    def _identify(self, conn: Connection, model: str | None):
        """The served model's description, its fields checked (a malformed one is one line, not a traceback)."""
        try:
            server = self.api.identify(conn, model)
        except EndpointError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise EndpointError(f"{conn.url}: its description of the served model is malformed "
                                f"({type(exc).__name__}: {exc}); is --api right?") from None
        return check_server(server, conn.url)

    def _identify_all(self, model: str | None):
        """The first server's description; every replica must serve the same model with the same vocabulary (the
        context is the smallest one), all before any prompt is sent."""
        first = self._identify(self.conns[0], model)
        contexts = [first.context]
        for conn in self.conns[1:]:
            other = self._identify(conn, model)
            if (other.model, other.vocab_size) != (first.model, first.vocab_size):
                raise EndpointError(f"{conn.url} serves {other.model} (vocabulary {other.vocab_size}), "
                                    f"{self.conns[0].url} {first.model} (vocabulary {first.vocab_size}): the "
                                    "endpoints of one run must be replicas of one model")
            contexts.append(other.context)
        known = [c for c in contexts if c]
        return replace(first, context=min(known) if known else None)

    def settings(self) -> dict[str, Any]:
        """What a journal must agree on to be resumed: the same server answers to the same requests."""
        return {"api": self.api.name, "model": self.model, "top_k": self.top_k, "reuse_prefix": self.reuse_prefix,
                "concurrency": self.concurrency, "endpoints": len(self.conns),
                "server_cache": self.cache_config}

    def report(self) -> dict[str, Any] | None:
        """What the server says about its own settings (its API's `report`), recorded beside the verdict."""
        from phasekv.engines.registry import running_settings

        return running_settings(self.api.name, self.conn)

    def attach(self, journal: Journal) -> None:
        """Journal every answer from now on; the journal's answers are not asked again."""
        for key, answer in journal.answers.items():  # an edited journal is refused like a broken answer
            problem = answer_problem(answer, None, vocab_size=self.info.vocab_size, top_k=self.top_k, sent=None)
            if problem is not None:
                raise EndpointError(f"{journal.path}: the answer {key} holds {problem}: remove the journal or use "
                                    "--force to start over")
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
            ids = torch.tensor([i for i, _ in answer.top], dtype=torch.long)  # checked: inside the vocabulary
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

            pool = ThreadPoolExecutor(self.concurrency * len(self.conns))
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
        """One group's prompts back to back on one server (a free slot of the least busy one: a group shares its
        prefix cache), then the slot is free again."""
        conn = self._free.get()
        try:
            self._send_on(conn, prompts, keys)
        finally:
            self._free.put(conn)

    def _send_on(self, conn: Connection, prompts: list[list[int]], keys: list[str]) -> None:
        for ids, key in zip(prompts, keys, strict=True):
            if key in self.answers:
                continue
            payload = conn.request("POST", self.api.path, self.api.body(ids, self.top_k, self.model,
                                                                         self.reuse_prefix))
            answer, read = self.api.parse(payload)
            check_answer(answer, read, vocab_size=self.info.vocab_size, top_k=self.top_k, sent=len(ids))
            if answer.cached and not self.reuse_prefix:  # vLLM caches prefixes unless told not to, whatever we ask
                raise EndpointError(f"the server reused {answer.cached} cached prompt tokens in a run without prompt "
                                    "cache: its prefix cache is on (vLLM: start it with --no-enable-prefix-caching; "
                                    "or audit the cached path with --reuse-prefix)")
            served = payload.get("model") if isinstance(payload, dict) else None
            with self._lock:  # the request threads count and store answers one at a time
                if isinstance(served, str):  # every answer must come from the model the first one came from
                    first = self.answered_by.setdefault(conn.url, served)
                    if served != first:
                        raise EndpointError(f"{conn.url} answered with model {served!r} after {first!r}: "
                                            "was it restarted with another model? (answers so far are journaled)")
                self.sent += 1
                self.answers[key] = answer
            if self.journal is not None:
                self.journal.add(key, answer)

    def continuation_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per (prompt, continuation): the log-probability of each continuation token, teacher-forced by the engine
        (its API's `continuation_logprobs`; `phasekv decide`), `concurrency` requests at a time per server, in
        order.  Not journaled here: `phasekv decide` journals each item once its prompts are scored."""
        if not self.api.scoring:
            raise EndpointError(f"--api {self.api.name}: phasekv cannot read a continuation's log-probability "
                                "through this API (llamacpp and openai/vLLM can)")
        if pairs:
            self.check_length(max(len(p) + len(c) for p, c in pairs))

        def one(pair: tuple[list[int], list[int]]) -> list[float]:
            conn = self._free.get()
            try:
                values, cached = self.api.continuation_logprobs(conn, list(pair[0]), list(pair[1]), self.model,
                                                                self.reuse_prefix)
            finally:
                self._free.put(conn)
            if cached and not self.reuse_prefix:
                raise EndpointError(f"the server reused {cached} cached prompt tokens in a run without prompt cache: "
                                    "its prefix cache is on (vLLM: start it with --no-enable-prefix-caching)")
            return values

        pool = ThreadPoolExecutor(self.concurrency * len(self.conns))
        try:
            return list(pool.map(one, pairs))
        finally:  # after a failure nothing more is sent
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        if self.journal is not None:
            self.journal.close()


def open_endpoint(options: EndpointOptions, out: str | Path | None = None, force: bool = False):
    """(EndpointAdapter, tokenizer) for `phasekv audit/eval --endpoint`: the tokenizer is read locally (the
    prompts are built as ids here), the server is checked to serve a model of that vocabulary, and, with `out`,
    answers go to the run's journal in OUT's temporary directory (`journal_path`; continued with `options.resume`,
    replaced with `force`); the command that publishes OUT publishes it inside OUT (`published`)."""
    from phasekv.adapters.hf import load_tokenizer

    if options.tokenizer is None:
        raise ValueError("--endpoint: needs --tokenizer DIR (the served model's tokenizer)")
    check_endpoint_options(options)  # before the (slow) tokenizer
    tokenizer = load_tokenizer(options.tokenizer, options.gguf_file, flag="--tokenizer")
    adapter = EndpointAdapter(options.url, options.api, len(tokenizer), model=options.model,
                              concurrency=options.concurrency, reuse_prefix=options.reuse_prefix,
                              timeout=options.timeout, replicas=options.replicas)
    if out is not None:
        journal = journal_path(out)
        adapter.attach(Journal(journal, adapter.settings(), resume=options.resume, fresh=force and not options.resume))
        log.info("journal %s: %d answers from an earlier run", journal, adapter.journal.resumed)
    return adapter, tokenizer


def check_reference(served: bool, reference: object | None) -> None:
    """A reference (the served weights in process, --reference-hf) is compared with a served model only."""
    if reference is not None and not served:
        raise ValueError("--reference-hf: compares a served model with its weights in process: needs --endpoint")
