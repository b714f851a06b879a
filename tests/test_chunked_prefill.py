"""Chunked prefill (`HFAdapter(prefill_chunk=C)`, `PhaseKVAdapter(prefill_chunk=C)`) against its reference, the
one-shot prefill: the same cache and the same query logits to 1e-5 on tiny transformers Llama / Qwen3 (eager and
sdpa) and phasekv models, with and without a shared prefix, chunks that divide the context and chunks that do not;
a post-hoc compression condition and a pooled selection give the same per-prompt answers either way; the memory
estimate follows the attention implementation and bounds the peak RSS of a 16K-token chunked prefill."""

from __future__ import annotations

import pytest
import torch

from phasekv.adapters.hf import MASK_BYTES, HFAdapter, forward_bytes
from phasekv.adapters.phasekv import PhaseKVAdapter
from phasekv.conditions.posthoc import PosthocAdapter
from phasekv.model import build_model
from tests.helpers import SMOL, SMOL_FILE, needs_real_model, tiny, tiny_causal_lm

VOCAB, T, Q = 61, 203, 3  # context length (prime: no chunk size divides it), query length


def _ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _pair(family: str, attention: str, chunk: int) -> tuple[HFAdapter, HFAdapter]:
    model = tiny_causal_lm(family, VOCAB, 512, attention)
    return HFAdapter(model, "one-shot"), HFAdapter(model, "chunked", prefill_chunk=chunk)


@pytest.mark.parametrize(("family", "attention"), [("llama", "eager"), ("llama", "sdpa"), ("qwen3", "sdpa")])
@pytest.mark.parametrize("chunk", [16, 50, 202, 203, 4096])
def test_chunked_prefill_equals_one_shot(family, attention, chunk):
    whole, chunked = _pair(family, attention, chunk)
    ids, queries = _ids(2, T, 1), _ids(2 * 2, Q, 2)
    (reference, length), (past, same) = whole.prefill(ids), chunked.prefill(ids)
    assert length == same == T
    for a, b in zip(reference.layers, past.layers):
        assert a.keys.shape == b.keys.shape == (2, 2, T, 8)
        torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.values, a.values, atol=1e-5, rtol=0)
    expected = whole.continue_from((reference, length), queries, 2)
    torch.testing.assert_close(chunked.continue_from((past, same), queries, 2), expected, atol=1e-5, rtol=0)
    # and against one forward per full prompt, the reference of the multi-query path
    full = whole.logits(torch.cat([ids.repeat_interleave(2, 0), queries], 1))[:, T:]
    torch.testing.assert_close(expected, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [7, 64])
def test_a_shared_prefix_is_prefilled_in_chunks_too(chunk):
    whole, chunked = _pair("llama", "sdpa", chunk)
    ids = _ids(3, T, 3)
    ids[:, :170] = ids[0, :170]  # 170 of 203 tokens in common: shared (SHARE_PREFIX_FROM)
    queries = _ids(3, Q, 4)
    expected = whole.continue_from(whole.prefill(ids), queries, 1)
    got = chunked.continue_from(chunked.prefill(ids, prefix=170), queries, 1)
    assert chunked._prefix is not None and len(chunked._prefix[0]) == 170
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5, 8, 37])
def test_a_phasekv_model_prefills_in_chunks(chunk):
    torch.manual_seed(0)
    model = build_model(tiny(compressor="gated", window=8, stride=4, vocab_size=VOCAB)).eval()
    whole, chunked = PhaseKVAdapter(model), PhaseKVAdapter(model, prefill_chunk=chunk)
    ids, queries = _ids(2, 150, 5), _ids(2 * 3, Q, 6)
    expected = whole.continue_from(whole.prefill(ids), queries, 3)
    torch.testing.assert_close(chunked.continue_from(chunked.prefill(ids), queries, 3), expected, atol=1e-5, rtol=0)
    full = whole.logits(torch.cat([ids.repeat_interleave(3, 0), queries], 1))[:, 150:]
    torch.testing.assert_close(expected, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy", ["mean", "select:3+keep-first:1", "max-norm"])
def test_a_posthoc_condition_answers_the_same_on_a_chunked_cache(policy):
    whole, chunked = _pair("qwen3", "sdpa", 32)
    ids, queries = _ids(8, T, 7), _ids(8, Q, 8)
    answers = []
    for inner in (whole, chunked):
        post = PosthocAdapter(inner, policy, window=8, stride=4, local_window=16)
        logits = post.continue_from(post.prefill(ids), queries, 1)[:, -1]  # (prompts, V)
        answers.append((logits.argmax(-1), logits, dict(post.bytes)))
    assert torch.equal(answers[0][0], answers[1][0])
    torch.testing.assert_close(answers[1][1], answers[0][1], atol=1e-5, rtol=0)
    assert answers[0][2] == answers[1][2] and answers[0][2]["compressed"] < answers[0][2]["full"]


def test_the_memory_estimate_follows_the_attention_implementation():
    config = tiny_causal_lm("llama", VOCAB, 512, "eager").config
    heads, length, chunk = config.num_attention_heads, 32768, 1024
    one_eager, one_sdpa = (forward_bytes(config, length, 1, 4, eager) for eager in (True, False))
    # eager's float32 scores and probabilities, and its mask (a one-shot sdpa prefill is causal without one)
    assert one_eager - one_sdpa == 2 * heads * length * length * 4 + length * length * MASK_BYTES
    eager, sdpa = (forward_bytes(config, length, 1, 4, e, chunk=chunk) for e in (True, False))
    assert eager - sdpa == 2 * heads * chunk * length * 4  # a chunk behind cached tokens: both build its mask
    assert sdpa < eager < one_eager / 16 and forward_bytes(config, length, 1, 4, False, chunk=length) == one_sdpa
    assert forward_bytes(config, length, 3, 4, True, chunk=chunk) == 3 * eager


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_chunk_is_one_line(bad):
    model = tiny_causal_lm("llama", VOCAB, 64, "sdpa")
    for make in (lambda: HFAdapter(model, "x", prefill_chunk=bad),
                 lambda: PhaseKVAdapter(build_model(tiny()), prefill_chunk=bad)):
        with pytest.raises(ValueError, match="prefill_chunk: must be an integer >= 0") as info:
            make()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("condition", ["mean", "kpool:pool=8,budget=0.25,local=16,indexer=oracle"])
def test_a_long_context_set_gets_the_same_answers_per_phase_chunked_or_not(condition):
    """A prompt set of `phasekv.data.longcontext` through a post-hoc condition and a pooled selection: chunked and
    one-shot prefill give the same answer to every prompt, hence the same accuracy in every phase group."""
    import transformers

    from phasekv.conditions.grammar import Geometry, condition_adapter
    from phasekv.data.keyspace import train_bpe
    from phasekv.data.longcontext import LongContextSet, LongContextSpec

    tokenizer = train_bpe("byte-level")
    prompts = LongContextSet(LongContextSpec(context=256, per_group=64), tokenizer)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)).float()
    model.config._attn_implementation = "sdpa"
    query = prompts.spec.key_tokens + 1  # the target's code and ":"
    batch = list(prompts.prompts(range(0, 64, 8)))  # 8 clusters x 8 shifts
    ids = torch.as_tensor([p.ids.tolist() for p in batch])
    right = {}
    for chunk in (0, 48):
        post = condition_adapter(HFAdapter(model, "llama", prefill_chunk=chunk), condition, Geometry(8, 8, 16))
        logits = post.continue_from(post.prefill(ids[:, :-query]), ids[:, -query:], 1)[:, -1]
        right[chunk] = [int(a) == p.answer for a, p in zip(logits.argmax(-1), batch)]
        assert torch.equal(logits.argmax(-1), right.setdefault("answers", logits.argmax(-1)))
    for phase in range(8):
        group = [i for i, p in enumerate(batch) if p.phase == phase]
        assert len(group) == 8 and sum(right[0][i] for i in group) == sum(right[48][i] for i in group)


@needs_real_model
def test_smollm2_prefills_a_long_context_set_in_chunks():
    """SmolLM2 (sdpa, float32) on a prompt of 1,024 tokens of the records family: chunked prefill gives the
    one-shot logits and answer."""
    from phasekv.adapters.hf import load_hf
    from phasekv.data.longcontext import LongContextSet, LongContextSpec

    adapter, tokenizer = load_hf(str(SMOL), gguf_file=SMOL_FILE)
    prompts = LongContextSet(LongContextSpec(context=1024, per_group=64), tokenizer)
    batch = [prompts.prompt(0, 5)]
    ids, query = torch.as_tensor([p.ids.tolist() for p in batch]), prompts.spec.key_tokens + 1
    out = []
    for chunk in (0, 200):
        adapter.prefill_chunk = chunk
        out.append(adapter.continue_from(adapter.prefill(ids[:, :-query]), ids[:, -query:], 1)[:, -1])
    torch.testing.assert_close(out[1], out[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))


def test_a_context_too_large_at_once_is_refused_in_one_line_and_prefilled_in_chunks(monkeypatch):
    from phasekv import memory

    whole, chunked = _pair("llama", "eager", 32)
    ids = _ids(1, T, 9)
    config = whole.module.config
    small, large = (forward_bytes(config, T, 1, 4, True, chunk=c) for c in (32, 0))
    monkeypatch.setattr(memory, "available_memory", lambda: (small + large) // 2)
    with pytest.raises(ValueError, match=r"^context: a forward of 1 x 203 tokens of one-shot: needs about .*; lower "
                                         r"--batch-size, the prompt length or the prefill chunk$"):
        whole.prefill(ids)
    past, length = chunked.prefill(ids)
    assert length == T and past.get_seq_length() == T
    monkeypatch.setattr(memory, "available_memory", lambda: small - 1)
    with pytest.raises(ValueError, match=r"^context: a forward of 1 x 203 tokens in chunks of 32 of chunked: needs"):
        chunked.prefill(ids)



@pytest.mark.parametrize(("indexer", "grid"), [("oracle", "fixed"), ("mean", "jitter"), ("max", "fixed"),
                                               ("distilled", "jitter"), ("distilled-minimax", "fixed")])
def test_pooled_selection_on_a_chunked_cache_equals_one_shot(indexer, grid, tmp_path):
    """A kpool condition (`conditions.selection`) over a chunked prefill: the cache, the hidden states a distilled
    indexer reads, and the queries' logits equal the one-shot prefill's to 1e-5, with a chunk that divides no pool
    boundary and one that ends one token short of the context.  (The distilled cases failed before the selection's
    hook joined the chunks' hidden states: each chunk's replaced the earlier ones'.)"""
    from phasekv.conditions.selection.pooled import SelectionAdapter, parse_selection
    from tests.test_selection import _indexer_name

    model = tiny_causal_lm("llama", VOCAB, 512, "sdpa")
    name, heads = _indexer_name(indexer, tmp_path)
    spec = parse_selection(f"kpool:pool=4,top=3,local=8,heads={heads},indexer={name},grid={grid}")
    ids, queries = _ids(2, T, 11), _ids(2 * 2, Q, 12)
    whole = SelectionAdapter(HFAdapter(model, "one-shot"), spec)
    reference = whole.prefill(ids)
    expected = whole.continue_from(reference, queries, 2)
    dense = HFAdapter(model, "dense")
    assert not torch.allclose(expected, dense.continue_from(dense.prefill(ids), queries, 2), atol=1e-3)  # it acts
    for chunk in (50, 202):
        chunked = SelectionAdapter(HFAdapter(model, "chunked", prefill_chunk=chunk), spec)
        cache = chunked.prefill(ids)
        for a, b in zip(reference[0][0].layers, cache[0][0].layers):
            torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=0)
        assert cache[1].keys() == reference[1].keys()  # the hidden states a distilled indexer reads (or none)
        for key, hidden in reference[1].items():
            torch.testing.assert_close(cache[1][key], hidden, atol=1e-5, rtol=0)
        torch.testing.assert_close(chunked.continue_from(cache, queries, 2), expected, atol=1e-5, rtol=0)


MEASURE_PEAK = r"""
import json, re, sys, torch
from phasekv.adapters.hf import HFAdapter, forward_bytes
from tests.helpers import tiny_causal_lm
length, chunk, attention = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
model = tiny_causal_lm("llama", 3000, length, attention)
ids = torch.randint(0, 3000, (1, length), generator=torch.Generator().manual_seed(0))
adapter = HFAdapter(model, "tiny", prefill_chunk=chunk)
adapter.continue_from(adapter.prefill(ids[:, :256]), ids[:, :3], 1)  # one-time costs (kernels, allocator) first
HFAdapter(model, "tiny", prefill_chunk=64).prefill(ids[:, :256])
def status(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
# the peak RSS (VmHWM) restarts from the current RSS: a high-water mark from before (imports, when every page of
# torch's libraries was resident, since evicted under memory pressure) would hide the prefill's growth
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
adapter.prefill(ids)
grown = status("VmHWM") - before
print(json.dumps({"grown": grown, "estimate": forward_bytes(model.config, length, 1, 4, attention == "eager",
                                                            chunk=chunk)}))
"""


@pytest.mark.parametrize(("length", "chunk", "attention"), [(16384, 2048, "sdpa"), (8192, 1024, "eager")])
def test_a_chunked_prefill_stays_within_its_memory_estimate(length, chunk, attention):
    """The peak RSS a chunked prefill of a long context adds (a fresh process, after a short warm-up forward; Linux's
    /proc/self/status) is
    within `forward_bytes`' estimate, which `check_memory` refuses a forward by, give or take the allocator's
    granularity (10%; measured: sdpa 16K/2K 0.88 of the estimate, eager 8K/1K 1.04), and not far below it (a bound,
    not a guess off by a factor).  Before the mask's bytes were counted the sdpa case grew 1.3x its estimate."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs (the peak RSS restarted before the prefill)")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", MEASURE_PEAK, str(length), str(chunk), attention], cwd=root,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"})
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert 0.6 * got["estimate"] <= got["grown"] <= 1.1 * got["estimate"], got
