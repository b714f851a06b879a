"""Multi-query evaluation of transformers models (phasekv.adapters.hf): the packed layout that reads the
prefilled cache in place equals one forward per full prompt and the slow reference (a deep copy of the cache
per query row), for the full cache and the post-hoc compressed ones, on tiny Llama and Qwen3 models with eager
and sdpa attention; the cache is left unchanged; a shared prefix is prefilled once and gives the same cache;
hooked models and other caches take the reference path; a forward that would not fit is refused before it runs;
the runner's multi-query predictions equal one-by-one on formats with several needles per context and with a
long shared preamble."""

import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from phasekv import memory  # noqa: E402
from phasekv.adapters import hf as adapter_module  # noqa: E402
from phasekv.adapters.hf import HFAdapter, query_mask  # noqa: E402
from phasekv.conditions.posthoc import PosthocAdapter  # noqa: E402
from phasekv.data.formats import FORMATS, FormatVocabulary, load_format  # noqa: E402
from phasekv.data.protocols import build_eval_set  # noqa: E402
from phasekv.evaluate.runner import predict  # noqa: E402
from tests.helpers import SMOL, SMOL_FILE, bpe_tokenizer, needs_real_model, tiny_causal_lm  # noqa: E402

VOCAB, T, Q, N = 61, 37, 3, 4  # context length, query length, queries per context


@pytest.fixture(scope="module", params=[("llama", "eager"), ("llama", "sdpa"), ("qwen3", "eager"),
                                        ("qwen3", "sdpa")], ids="-".join)
def hf(request) -> HFAdapter:
    return HFAdapter(tiny_causal_lm(*request.param[:1], VOCAB, 256, request.param[1]), "-".join(request.param))


def _ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


class Forwards:
    """Records the token shape of every forward of a module, by wrapping its forward method (a registered hook
    would send the queries down the reference path)."""

    def __init__(self, module):
        self.module, self.shapes = module, []

    def __enter__(self):
        original = self.module.forward

        def forward(*args, **kwargs):
            self.shapes.append(tuple(kwargs["input_ids"].shape))
            return original(*args, **kwargs)

        self.module.forward = forward
        return self

    def __exit__(self, *exc):
        del self.module.forward


def test_query_mask_by_hand():
    mask = query_mask(2, 2, 2, torch.float32, "cpu")[0, 0] == 0  # visible
    assert mask.tolist() == [[True, True, True, False, False, False],
                             [True, True, True, True, False, False],
                             [True, True, False, False, True, False],
                             [True, True, False, False, True, True]]


def test_packed_queries_equal_one_forward_per_prompt_and_the_copies(hf):
    contexts, queries = _ids(3, T, 1), _ids(3 * N, Q, 2)
    cache = hf.prefill(contexts)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache[0].layers]
    assert hf.reads_in_place(cache[0])
    got = hf.continue_from(cache, queries, N)
    full = hf.logits(torch.cat([contexts.repeat_interleave(N, 0), queries], 1))[:, T:]  # (3N, Q, V)
    copies = hf.continue_by_copies(cache, queries, N)
    assert torch.allclose(got, full, atol=1e-5) and torch.allclose(got, copies, atol=1e-5)
    assert torch.equal(got[:, -1].argmax(-1), full[:, -1].argmax(-1))
    assert (got[:N] - got[N:2 * N]).abs().max() > 1e-3  # the contexts really differ
    for (k, v), layer in zip(before, cache[0].layers, strict=True):  # the cache was read, never written
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


@pytest.mark.parametrize("policy", ["select:3+keep-first:1", "mean", "max-norm+keep-first:2"])
def test_packed_queries_on_a_posthoc_cache_equal_the_copies(hf, policy):
    post = PosthocAdapter(hf, policy, window=8, stride=4, local_window=5)
    contexts, queries = _ids(2, T, 3), _ids(2 * N, Q, 4)
    cache = post.prefill(contexts)
    assert cache[0].get_seq_length() < T and hf.reads_in_place(cache[0])
    got = post.continue_from(cache, queries, N)
    assert torch.allclose(got, hf.continue_by_copies(cache, queries, N), atol=1e-5)
    assert (got - hf.continue_from(hf.prefill(contexts), queries, N)).abs().max() > 1e-3  # compression mattered


def test_a_shared_prefix_is_prefilled_once_and_gives_the_same_cache(hf):
    hf._prefix = None
    shared = _ids(1, 30, 5).expand(3, -1)
    contexts = torch.cat([shared, _ids(3, 8, 6)], 1)  # 30 of 38 tokens shared: above SHARE_PREFIX_FROM
    plain = hf.prefill(contexts)
    with Forwards(hf.module) as seen:
        first, again = hf.prefill(contexts, prefix=30), hf.prefill(contexts[:2], prefix=30)
    assert seen.shapes == [(1, 30), (3, 8), (2, 8)]  # the prefix once, then only the suffixes
    for a, b, c in zip(plain[0].layers, first[0].layers, again[0].layers, strict=True):
        assert a.keys.shape == b.keys.shape == (3, *a.keys.shape[1:])
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
        assert torch.equal(b.keys[:2], c.keys)
    queries = _ids(3 * N, Q, 7)
    assert torch.allclose(hf.continue_from(first, queries, N), hf.continue_from(plain, queries, N), atol=1e-5)
    with Forwards(hf.module) as seen:  # another prefix replaces the kept one; a short prefix is not shared
        hf.prefill(torch.cat([_ids(1, 30, 8).expand(2, -1), _ids(2, 8, 6)], 1), prefix=30)
        hf.prefill(contexts, prefix=10)
    assert seen.shapes == [(1, 30), (2, 8), (3, 38)]
    with pytest.raises(ValueError, match="^prefix: the rows differ within their first 31 tokens$"):
        hf.prefill(contexts, prefix=31)


def test_hooked_models_and_other_caches_take_the_reference_path(hf):
    contexts, queries = _ids(2, T, 9), _ids(2 * N, Q, 10)
    cache = hf.prefill(contexts)
    want = hf.continue_from(cache, queries, N)
    rows = []
    o_proj = hf.attention_layers()[0].o_proj
    handle = o_proj.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[:2]))
    try:
        assert not hf.reads_in_place(cache[0])
        assert torch.allclose(hf.continue_from(cache, queries, N), want, atol=1e-5)
    finally:
        handle.remove()
    assert rows == [(2 * N, Q)]  # one query per row, as a hook reading the final position expects
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=64) for _ in cache[0].layers]
    assert not hf.reads_in_place(sliding)


def test_a_forward_that_would_not_fit_is_refused_before_it_runs(hf, monkeypatch):
    contexts = _ids(2, T, 11)
    need = adapter_module.forward_bytes(hf.module.config, T, 2, 4, hf.module.config._attn_implementation == "eager")
    monkeypatch.setattr(memory, "available_memory", lambda: need - 1)
    with Forwards(hf.module) as seen:
        for call in (lambda: hf.prefill(contexts), lambda: hf.next_logits(contexts), lambda: hf.logits(contexts)):
            with pytest.raises(ValueError, match=r"^context: a forward of 2 x 37 tokens of .* needs about [\d.]+ "
                                                 r"GiB, only [\d.]+ GiB of memory is available; lower --batch-size"):
                call()
        assert seen.shapes == []  # nothing ran
        monkeypatch.setattr(memory, "available_memory", lambda: need)
        hf.prefill(contexts)
    assert seen.shapes == [(2, T)]


def test_the_estimate_grows_with_rows_length_and_eager_scores():
    config = tiny_causal_lm("llama", VOCAB, 256, "sdpa").config
    one = adapter_module.forward_bytes(config, 1000, 1, 4, eager=False)
    assert adapter_module.forward_bytes(config, 1000, 3, 4, eager=False) == 3 * one
    assert adapter_module.forward_bytes(config, 2000, 1, 4, eager=False) > 1.9 * one
    # eager adds its (heads, T, T) float32 scores and probabilities, 4 heads x 1000^2 x 4 bytes x 2, and its (T, T)
    # mask (a one-shot sdpa prefill is causal without one)
    eager = adapter_module.forward_bytes(config, 1000, 1, 4, eager=True)
    assert eager - one == 4 * 1000 ** 2 * 4 * 2 + 1000 ** 2 * adapter_module.MASK_BYTES


@pytest.fixture(scope="module")
def prose():
    tokenizer = bpe_tokenizer(prose=True)
    return tokenizer, HFAdapter(tiny_causal_lm("llama", len(tokenizer), 4096, "sdpa"), "tiny-llama")


NEEDLE = dataclasses.replace(FORMATS["needle"], haystack_tokens=16)
PREAMBLE = dataclasses.replace(FORMATS["needle-4k"], preamble_tokens=1800, haystack_tokens=16)  # 78% of the context


@pytest.mark.parametrize(("fmt", "protocol"), [(NEEDLE, "prefix"), (NEEDLE, "insequence"), (PREAMBLE, "prefix")],
                         ids=["needle-prefix", "needle-insequence", "preamble-prefix"])
def test_runner_multi_query_equals_one_by_one_with_several_needles_per_context(prose, monkeypatch, fmt, protocol):
    tokenizer, hf = prose
    vocab = FormatVocabulary(fmt, tokenizer)
    kt, vt = vocab.record_shape
    families = math.gcd(kt + vt + fmt.haystack_tokens + (protocol == "insequence"), 8)  # the fewest clusters
    eval_set = build_eval_set(vocab, protocol, n_records=16, n_demos=2, stride=8, residue_modulus=8,
                              n_clusters=families, key_tokens=kt, value_tokens=vt, local_window=16)
    assert max(len(c.queries) for c in eval_set.contexts) > 1  # several needles of one context are queried
    hf._prefix = None
    with Forwards(hf.module) as seen:
        multi = predict(hf, eval_set, batch_size=16, progress=False)
    single = predict(hf, eval_set, batch_size=16, multi_query=False, progress=False)
    assert [r["prediction"] for r in multi] == [r["prediction"] for r in single]
    if fmt.preamble_tokens:  # the preamble was prefilled once; no other forward holds it
        shared = seen.shapes[0][1]
        assert seen.shapes[0][0] == 1 and shared > len(vocab.header) >= fmt.preamble_tokens
        assert all(length < shared for _, length in seen.shapes[1:])
    else:  # one prefill and one continuation per batch of contexts
        per_batch = 16 // len(eval_set.contexts[0].queries)
        assert len(seen.shapes) == 2 * math.ceil(len(eval_set.contexts) / per_batch)
    post = PosthocAdapter(hf, "select:3+keep-first:1", window=8, stride=8, local_window=16)
    packed = predict(post, eval_set, batch_size=16, progress=False)
    monkeypatch.setattr(hf, "reads_in_place", lambda past: False)  # the reference: a cache copy per query row
    copies = predict(post, eval_set, batch_size=16, progress=False)
    assert [r["prediction"] for r in packed] == [r["prediction"] for r in copies]


@pytest.mark.slow
@needs_real_model
def test_real_model_packed_queries_equal_the_copies_at_1k_tokens():
    from phasekv.adapters.hf import load_hf

    hf, tokenizer = load_hf(str(SMOL), "cpu", "float32", gguf_file=SMOL_FILE)
    vocab = FormatVocabulary(load_format("needle"), tokenizer)
    kt, vt = vocab.record_shape
    eval_set = build_eval_set(vocab, "prefix", n_records=16, n_demos=2, stride=8, residue_modulus=8, n_clusters=1,
                              key_tokens=kt, value_tokens=vt, local_window=16)
    context = eval_set.contexts[0]
    cache = hf.prefill(torch.tensor([context.ids]))
    queries = torch.tensor([list(q.key) for q in context.queries])
    assert hf.reads_in_place(cache[0]) and len(queries) == 8
    got, want = hf.continue_from(cache, queries, len(queries)), hf.continue_by_copies(cache, queries, len(queries))
    assert torch.allclose(got, want, atol=1e-3) and torch.equal(got[:, -1].argmax(-1), want[:, -1].argmax(-1))
