"""phasekv decide through engines: continuation log-probabilities read from llama.cpp's /completion (the token forced
by logit_bias) and vLLM's /v1/completions (prompt_logprobs), against a stand-in server computing a tiny transformers
model (exact agreement with the same model in process, and a planted phase bug the comparison must catch), the
refusals, the seeded stratified --items sample, and (real) SmolLM2 served by llama-server and vLLM beside --hf."""

import json

import pytest
import torch

from phasekv.adapters.hf import HFAdapter
from phasekv.decisions.pipeline import adapter_scorer, run_decide
from phasekv.decisions.prompts import build_prompts
from phasekv.decisions.served import endpoint_scorer
from phasekv.decisions.sets import load_set, sample
from phasekv.decisions.stats import compare
from phasekv.engines.client import EndpointAdapter
from phasekv.engines.wire import EndpointError
from tests.engine import LoopbackServer, QuietHandler, engine_present, vllm_present
from tests.fake_llama_server import send_body
from tests.helpers import SMOL, SMOL_FILE, needs_real, tiny_causal_lm
from tests.test_decisions import WordTokenizer, tiny_set

VOCAB = 64


class ModelServer(LoopbackServer):
    """A stand-in engine computing a tiny causal LM: llama.cpp's /completion (n_probs, logit_bias, the sampled token's
    raw log-probability) and /v1/completions without prompt log-probabilities (`mode="llamacpp"`), or vLLM's
    /v1/completions with prompt_logprobs (`mode="vllm"`).  `corrupt(ids)`: True shifts that request's log-probabilities
    by -1 nat for the token asked about (a planted bug); `honor_bias=False`: logit_bias is ignored."""

    def __init__(self, model, mode: str, corrupt=lambda ids: False, honor_bias: bool = True):
        self.model, self.requests = model, 0
        server = self

        def logprobs(ids: list[int]) -> torch.Tensor:  # (T, V)
            with torch.no_grad():
                return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)

        class Handler(QuietHandler):
            def _send(self, payload, status=200):
                send_body(self, status, json.dumps(payload).encode())

            def do_GET(self):
                if self.path == "/health":
                    self._send({"status": "ok"})
                elif self.path == "/props" and mode == "llamacpp":
                    self._send({"model_path": "/m/tiny.gguf", "default_generation_settings": {"n_ctx": 256}})
                elif self.path == "/v1/models":
                    self._send({"data": [{"id": "tiny", "max_model_len": 256, "meta": {"n_vocab": VOCAB}}]})
                else:
                    self._send({"error": {"message": "not found"}}, 404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ids = list(body["prompt"])
                server.requests += 1
                lp = logprobs(ids)
                bad = corrupt(ids)
                if self.path == "/completion":
                    last = lp[-1].clone()
                    biased = last.clone()
                    for token, bias in body.get("logit_bias", []) if honor_bias else []:
                        biased[token] += bias
                    token = int(biased.argmax())
                    top = [{"id": int(i), "logprob": float(last[i])} for i in last.argsort(descending=True)[:2]]
                    self._send({"model": "/m/tiny.gguf", "tokens_evaluated": len(ids), "timings": {"cache_n": 0},
                                "completion_probabilities": [{"id": token, "logprob": float(last[token]) - bad,
                                                              "top_logprobs": top}]})
                    return
                token = int(lp[-1].argmax())
                choice = {"text": "", "logprobs": {"tokens": [f"token_id:{token}"],
                                                   "top_logprobs": [{f"token_id:{token}": float(lp[-1, token])}]}}
                if mode == "vllm" and body.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = [None] + [
                        {str(t): {"logprob": float(lp[i - 1, t]) - bad, "rank": 1, "decoded_token": ""}}
                        for i, t in enumerate(ids) if i > 0]
                self._send({"model": "tiny", "choices": [choice], "usage": {"prompt_tokens": len(ids)}})

        self._serve(Handler)


@pytest.fixture(scope="module")
def tiny():
    return tiny_causal_lm("llama", VOCAB, 256, "eager").eval()


def prompts_of(n=4):
    s = tiny_set(n=n, continuations={"yes": " yes it is", "no": " no"})
    return build_prompts(WordTokenizer(), s, shifts=4, stride=4)


@pytest.mark.parametrize("mode,api", [("llamacpp", "llamacpp"), ("vllm", "openai")])
def test_served_continuations_equal_the_same_model_in_process(tmp_path, tiny, mode, api):
    prompts = prompts_of()
    with ModelServer(tiny, mode) as server:
        adapter = EndpointAdapter(server.url, api, VOCAB, concurrency=2)
        summary = run_decide(endpoint_scorer(adapter), prompts, tmp_path / "out", conditions=["none"],
                             settings={"model": "tiny", "stride": 4, "n_perm": 50, "n_boot": 50},
                             reference=adapter_scorer(HFAdapter(tiny, "tiny"), None, progress=False), progress=False)
        adapter.close()
    # llama.cpp: one request per continuation token (3 + 1 per prompt); vLLM: one per continuation
    assert server.requests == len(prompts) * (4 if mode == "llamacpp" else 2)
    comparison = summary["comparison"]
    assert comparison["overall"]["agreement"] == 1.0 and comparison["overall"]["n"] == len(prompts)
    assert comparison["overall"]["max_abs_logp_diff"] < 1e-4
    assert [g["phase"] for g in comparison["per_phase"]] == [0, 1, 2, 3]
    rows = [json.loads(line) for line in (tmp_path / "out" / "decisions.jsonl").read_text().splitlines()]
    assert {r["condition"] for r in rows} == {"none", "reference"}
    assert all(len(r["logp"]) == 2 for r in rows)
    assert "decisions alike" in (tmp_path / "out" / "report.html").read_text()


def test_the_comparison_catches_a_served_model_wrong_at_one_phase(tiny):
    from phasekv.decisions.pipeline import decision_row

    prompts = prompts_of()
    bad_phase = prompts[1].phase
    # the first continuation token after a prompt of the bad phase loses 1 nat (llama.cpp asks one token per request:
    # the first one with the prompt alone)
    bad = {p.ids for p in prompts if p.phase == bad_phase}
    with ModelServer(tiny, "llamacpp", corrupt=lambda ids: 1.0 * (tuple(ids) in bad)) as server:
        adapter = EndpointAdapter(server.url, "llamacpp", VOCAB)
        scores = endpoint_scorer(adapter)("none", prompts)
        adapter.close()
    reference = adapter_scorer(HFAdapter(tiny, "tiny"), None, progress=False)("none", prompts)
    served = [decision_row(p, s) for p, s in zip(prompts, scores)]
    ref = [decision_row(p, s) for p, s in zip(prompts, reference)]
    by_phase = {g["phase"]: g for g in compare(served, ref, 4)["per_phase"]}
    assert by_phase[bad_phase]["max_abs_logp_diff"] == pytest.approx(1.0, abs=1e-4)
    assert all(g["max_abs_logp_diff"] < 1e-4 for phase, g in by_phase.items() if phase != bad_phase)


def test_refusals_are_one_line(tiny):
    prompts = prompts_of(n=1)
    with ModelServer(tiny, "llamacpp") as server:  # llama.cpp's /v1/completions has no prompt log-probabilities
        adapter = EndpointAdapter(server.url, "openai", VOCAB)
        with pytest.raises(EndpointError, match="without prompt_logprobs.*--api llamacpp"):
            endpoint_scorer(adapter)("none", prompts)
        with pytest.raises(ValueError, match="only none"):
            endpoint_scorer(adapter)("select:1", prompts)
        adapter.close()
    with ModelServer(tiny, "llamacpp", honor_bias=False) as server:
        adapter = EndpointAdapter(server.url, "llamacpp", VOCAB)
        with pytest.raises(EndpointError, match="logit_bias did not force"):
            endpoint_scorer(adapter)("none", prompts)
        adapter.close()


def test_decide_flags_are_checked_before_anything_loads(capsys, tmp_path):
    from phasekv.cli import main

    (tmp_path / "tok").mkdir()
    for argv, match in [(["--hf", "x", "--tokenizer", "y"], "--tokenizer: applies to --endpoint or --launch only"),
                        (["--endpoint", "http://127.0.0.1:1"], "need --tokenizer"),
                        (["--endpoint", "http://127.0.0.1:1", "--tokenizer", "t", "--compress", "select:3"],
                         "not available with --endpoint"),
                        (["--launch", "vllm", "--tokenizer", str(tmp_path / "tok")], "not a model folder"),
                        ([], "give the model")]:
        assert main(["decide", *argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0], err


def test_decide_launch_runs_the_stand_in_llama_server_end_to_end(tmp_path, capsys):
    from phasekv.cli import main
    from tests.helpers import bpe_tokenizer
    from tests.test_engine_grid import fake_engine

    tokenizer = bpe_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    binary, model = fake_engine(tmp_path, len(tokenizer))
    words = [("alpha", "red", "blue"), ("beta", "green", "red"), ("gamma", "blue", "green"), ("delta", "red", "green")]
    items = "".join(f'- {{id: i{i}, context: "key {w} value {v}\\n#[[pad]]\\nkey {w} value", '
                    f'continuations: {{right: " {v}", wrong: " {u}"}}}}\n' for i, (w, v, u) in enumerate(words))
    (tmp_path / "set.yaml").write_text(f"name: induction\npadding: {{kind: blank-lines, unit: \"\\n\"}}\n"
                                       f"answer: right\nitems:\n{items}")
    argv = ["decide", "--launch", "llama-server", "--engine-bin", str(binary), "--engine-model", str(model),
            "--tokenizer", str(tmp_path / "tok"), "--set", str(tmp_path / "set.yaml"), "--stride", "4",
            "--permutations", "50", "--no-progress", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    assert "scoring: llama.cpp: one request per continuation token" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # the stand-in's rule copies the value after the repeated key: every prompt decides `right`
    assert summary["conditions"]["none"]["effect"]["mean"] == 1.0 and summary["items"] == 4
    assert list(summary["conditions"]) == ["none"] and summary["settings"]["engine"]["api"] == "llamacpp"


# ----------------------------------------------------------------------------- --items: the stratified sample


def test_items_is_a_seeded_sample_stratified_by_kind():
    questions = load_set("questions")
    kinds = {item.kind for item in questions.items}
    assert len(kinds) == 5  # yes/no with each answer, three-way choice with each answer
    chosen = sample(questions.items, 24, seed=0)
    assert len(chosen) == 24 and {item.kind for item in chosen} == kinds
    counts = {k: sum(item.kind == k for item in chosen) for k in kinds}
    assert counts == {"no/yes:yes": 9, "no/yes:no": 9, "A/B/C:A": 2, "A/B/C:B": 2, "A/B/C:C": 2}
    order = [item.id for item in questions.items]
    assert [order.index(item.id) for item in chosen] == sorted(order.index(item.id) for item in chosen)
    assert [i.id for i in sample(questions.items, 24, seed=0)] == [i.id for i in chosen]  # seeded
    assert [i.id for i in sample(questions.items, 24, seed=1)] != [i.id for i in chosen]
    assert [i.id for i in chosen] != order[:24]  # not the first N
    few = sample(questions.items, 3, seed=0)
    assert len({item.kind for item in few}) == 3  # fewer items than kinds: one each of N kinds
    assert sample(questions.items, None) == list(questions.items) == sample(questions.items, 500)
    prompts = build_prompts(WordTokenizer(), tiny_set(n=12), shifts=2, stride=2, items=5, seed=3)
    assert len({p.item for p in prompts}) == 5


# ----------------------------------------------------------------------------- real engines


def served_decide(tmp_path, source: list[str], items: int = 6):
    from phasekv.cli import main

    out = tmp_path / "served"
    argv = ["decide", *source, "--tokenizer", str(SMOL), "--gguf-file", SMOL_FILE, "--reference-hf", str(SMOL),
            "--set", "questions", "--items", str(items), "--stride", "4", "--threads", "1", "--no-progress",
            "--permutations", "200", "--out", str(out)]
    assert main(argv) == 0
    return json.loads((out / "summary.json").read_text())


@needs_real(engine_present, "llama-server not built (make engine) or real model absent (make real-model)")
def test_llama_server_continuations_agree_with_hf_on_smollm2(tmp_path):
    from tests.engine import LLAMA_SERVER

    summary = served_decide(tmp_path, ["--launch", "llama-server", "--engine-bin", str(LLAMA_SERVER)])
    comparison = summary["comparison"]
    assert "logit_bias" in summary["settings"]["scoring"]
    assert comparison["overall"]["n"] == 6 * 4 and len(comparison["per_phase"]) == 4
    # measured on b11434 (Q4_1 weights; transformers dequantizes them, llama.cpp multiplies them quantized): 24/24
    # decisions agree, continuation log-probabilities 0.060 nats apart on average, 0.287 at most; bounds ~2.5x that
    assert comparison["overall"]["agreement"] >= 0.9
    assert comparison["overall"]["mean_abs_logp_diff"] < 0.15
    assert all(g["max_abs_logp_diff"] < 0.75 and g["n"] == 6 for g in comparison["per_phase"])


@needs_real(vllm_present and (SMOL / SMOL_FILE).is_file(), "vLLM not installed (make vllm) or real model absent")
@pytest.mark.slow
def test_vllm_continuations_agree_with_hf_on_smollm2(tmp_path):
    from tests.engine import VLLM_MODEL, vllm_server

    with vllm_server() as url:
        from phasekv.cli import main

        out = tmp_path / "served"
        assert main(["decide", "--endpoint", url, "--api", "openai", "--tokenizer", str(VLLM_MODEL), "--reference-hf",
                     str(VLLM_MODEL), "--set", "questions", "--items", "6", "--stride", "4", "--threads", "1",
                     "--no-progress", "--permutations", "200", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    comparison = summary["comparison"]
    assert "prompt_logprobs" in summary["settings"]["scoring"] and comparison["overall"]["n"] == 24
    # measured: 24/24 agree, log-probabilities under 5e-5 apart (float32 weights on both sides)
    assert comparison["overall"]["agreement"] >= 0.9 and comparison["overall"]["max_abs_logp_diff"] < 1e-3
