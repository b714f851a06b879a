"""Hybrid models under every in-process audit condition (phasekv.conditions.hybrid): tiny configs of transformers'
own classes, one per family (Gemma 3 sliding-window, GPT-OSS alternating sliding/full with learned sinks, Llama 4
chunked + NoPE global, Qwen3-Next linear + full).  Each condition acts on the full-attention layers only, equals a
slow reference there, leaves the other layers' outputs bit-identical to the unconditioned model, and never reads
the future; `phasekv audit` records which layers each condition touched."""

from __future__ import annotations

import json

import pytest
import torch

from phasekv.adapters.hf import HFAdapter
from phasekv.conditions.grammar import Geometry, condition_adapter
from phasekv.conditions.head_slices import MaskState, masking
from phasekv.conditions.hybrid import cache_plan, layer_bytes, layer_kinds, softmax_with_sinks, touched
from phasekv.conditions.posthoc import cache_bytes, window_starts

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=512)
FAMILIES = {  # name -> (config class, causal-LM class, fields, layer kinds)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
               ["sliding", "sliding", "full"]),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                     num_local_experts=2, num_experts_per_tok=1,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                ["sliding", "full"]),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(num_hidden_layers=2, attention_chunk_size=8, no_rope_layers=[1, 0], moe_layers=[],
                    intermediate_size_mlp=64),
               ["chunked", "full"]),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32),
                   ["linear", "full"]),
}
CONDITIONS = ("select:3+keep-first:1", "mean", "kpool:pool=4,budget=0.25,indexer=oracle",
              "slices:kind=contiguous,size=4,local=8,group=query", "stagger:select:3")
GEOMETRY = Geometry(window=8, stride=8, local_window=16)
CONTEXT, QUERY = 48, 3


def build(family: str, vocab: int = 64, attention: str = "eager"):
    torch.manual_seed(0)
    config_class, model_class, fields, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(vocab_size=vocab, **COMMON, **fields)
    model = getattr(transformers, model_class)(config).float().eval()
    model.config._attn_implementation = attention
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, HFAdapter(build(request.param), request.param)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, CONTEXT), generator=g), torch.randint(0, 64, (4, QUERY), generator=g)


def _left_modules(model):
    """The attention (or linear-attention) module of every layer a condition leaves, by layer index."""
    kinds = layer_kinds(model)
    out = {}
    for i, layer in enumerate(model.model.layers):
        if kinds[i] != "full":
            out[i] = getattr(layer, "self_attn", None) or layer.linear_attn
    return out


def _outputs(adapter, modules, run):
    """Run `run()` and return each module's first output (B, T, hidden) of every call, in order."""
    seen = {i: [] for i in modules}
    handles = [m.register_forward_hook(lambda mod, a, out, i=i: seen[i].append(
        (out[0] if isinstance(out, tuple) else out).detach().clone())) for i, m in modules.items()]
    try:
        result = run()
    finally:
        for h in handles:
            h.remove()
    return result, seen


def test_layer_kinds_and_the_cache_plan_follow_the_model(family):
    name, adapter = family
    kinds = FAMILIES[name][3]
    assert layer_kinds(adapter.module) == kinds
    past, _ = adapter.prefill(_inputs()[0])
    assert cache_plan(past, kinds) == kinds
    assert touched(adapter.module, True)["compressed"] == [kinds.index("full")]
    assert touched(adapter.module, False) == {"compressed": [], "left": {str(i): k for i, k in enumerate(kinds)},
                                              "kinds": kinds}


@pytest.mark.parametrize("condition", CONDITIONS)
def test_every_condition_runs_and_leaves_the_other_layers_bit_identical(family, condition):
    name, adapter = family
    context, queries = _inputs()
    cond = condition_adapter(adapter, condition, GEOMETRY)
    left = _left_modules(adapter.module)
    base, base_out = _outputs(adapter, left, lambda: adapter.continue_from(adapter.prefill(context), queries, 2))
    out, cond_out = _outputs(adapter, left, lambda: cond.continue_from(cond.prefill(context), queries, 2))
    assert out.shape == base.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, base, atol=1e-6)  # the condition acts (on the full layer)
    # every left layer here runs before the first full layer: same inputs, so bit-identical outputs
    for i in left:
        assert all(torch.equal(a, b) for a, b in zip(base_out[i], cond_out[i], strict=True)), (name, condition, i)


@pytest.mark.parametrize("condition", CONDITIONS)
def test_no_condition_reads_the_future(family, condition):
    _, adapter = family
    context, queries = _inputs()
    cond = condition_adapter(adapter, condition, GEOMETRY)
    cache = cond.prefill(context)
    changed = queries.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    a, b = cond.continue_from(cache, queries, 2), cond.continue_from(cache, changed, 2)
    # GPT-OSS's experts round differently with the batch's other tokens (6e-8 unconditioned too): a leak is 1e-2
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6, rtol=0) and not torch.allclose(a[:, -1], b[:, -1])
    later = context.clone()
    later[:, -1] = (later[:, -1] + 1) % 64  # the last context token: the context's own compression never moves
    c = cond.continue_from(cond.prefill(later), queries, 2)
    assert not torch.equal(a, c)


class _SelectRule:
    """The slow reference of post-hoc select on the full layers: each query sees, of the context, exactly the
    positions select:r+keep-first:n keeps (listed by hand), and every earlier context token sees all."""

    def __init__(self, offset: int, sink: int, context: int):
        starts = window_starts(context, GEOMETRY.window, GEOMETRY.stride, GEOMETRY.local_window)
        covered = starts[-1] + GEOMETRY.window
        self.kept = sorted(set(range(sink)) | {s + offset for s in starts if s + offset >= sink}
                           | set(range(covered, context)))
        self.context = context

    def keep(self, *, layer, layers, geometry, groups, offsets):
        s, t = geometry.key_pos, geometry.query_pos
        kept = torch.isin(s, torch.tensor(self.kept)) | (s >= self.context)  # (Tk,)
        rows = torch.where((t >= self.context)[:, None], kept[None], torch.ones_like(kept)[None])  # (Tq, Tk)
        return rows[None, None].expand(1, groups, -1, -1)


def test_posthoc_select_equals_the_masked_whole_forward_reference(family):
    _, adapter = family
    context, queries = _inputs()
    cond = condition_adapter(adapter, "select:3+keep-first:1", GEOMETRY)
    fast = cond.continue_from(cond.prefill(context), queries, 2)
    whole = torch.cat([context.repeat_interleave(2, 0), queries], 1)
    with torch.no_grad(), masking(adapter.module, MaskState(_SelectRule(3, 1, CONTEXT))):
        slow = adapter.module(input_ids=whole, use_cache=False).logits[:, -QUERY:]
    assert torch.allclose(fast, slow, atol=2e-5), (fast - slow).abs().max()


def test_compressed_cache_bookkeeping_counts_every_layer_type(family):
    name, adapter = family
    context, _ = _inputs()
    cond = condition_adapter(adapter, "select:3+keep-first:1", GEOMETRY)
    past, length = cond.prefill(context)
    full, _ = adapter.prefill(context)
    kinds = FAMILIES[name][3]
    target = kinds.index("full")
    assert cond.bytes == {"full": cache_bytes(full), "compressed": cache_bytes(past)}
    assert cond.bytes["compressed"] < cond.bytes["full"]
    for i, kind in enumerate(kinds):  # left layers hold what the model holds; the full one fewer entries
        assert (layer_bytes(past.layers[i]) == layer_bytes(full.layers[i])) == (kind != "full")
    held = past.layers[target].keys.shape[2]
    assert past.layers[target].get_seq_length() == length == CONTEXT and held < CONTEXT
    assert len(_SelectRule(3, 1, CONTEXT).kept) == held


def test_the_sink_softmax_equals_gpt_oss_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    class Module(torch.nn.Module):
        num_key_value_groups, training = 2, False

    module = Module()
    module.sinks = torch.nn.Parameter(torch.randn(4))
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    expected, _ = eager_attention_forward(module, q, k, v, None, scaling=0.3, dropout=0.0)
    logits = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    got = torch.matmul(softmax_with_sinks(logits, module.sinks), v.repeat_interleave(2, 1)).transpose(1, 2)
    assert torch.allclose(got, expected, atol=1e-6)


def test_selection_with_sinks_equals_its_slow_reference():
    from phasekv.conditions.selection.kernel import chunked_attention, reference_attention
    from phasekv.conditions.selection.pooled import parse_selection
    from phasekv.conditions.selection.scorers import make_indexer

    torch.manual_seed(0)
    spec, indexer = parse_selection("kpool:pool=4,top=2,local=4,sink=1"), make_indexer("oracle")
    q, k, v, sinks = torch.randn(2, 4, 24, 8), torch.randn(2, 2, 24, 8), torch.randn(2, 2, 24, 8), torch.randn(4)
    fast = chunked_attention(spec, indexer, None, q, k, v, attention_mask=None, query_pos=torch.arange(24),
                             scaling=8 ** -0.5, sinks=sinks).transpose(1, 2)
    slow = reference_attention(spec, indexer, None, q, k, v, sinks=sinks)
    assert torch.allclose(fast, slow, atol=1e-5)
    plain = chunked_attention(spec, indexer, None, q, k, v, attention_mask=None, query_pos=torch.arange(24),
                              scaling=8 ** -0.5).transpose(1, 2)
    assert not torch.allclose(fast, plain, atol=1e-3)  # the sinks matter


def test_a_press_refuses_a_hybrid_model_in_one_line():
    from phasekv.conditions.presses import PressAdapter

    adapter = HFAdapter(build("gemma3"), "gemma3")
    with pytest.raises(ValueError, match="full/sliding layers; kvpress"):
        PressAdapter(adapter, "knorm:ratio=0.5")


def test_a_hybrid_model_never_shares_a_prefix_cache():
    """A shared prefix is a broadcast of full-attention keys: a window or a recurrent state cannot be broadcast."""
    from tests.helpers import tiny_causal_lm

    assert HFAdapter(tiny_causal_lm("llama", 64, 128, "sdpa"), "llama").shares_prefix
    for name in FAMILIES:
        adapter = HFAdapter(build(name), name)
        assert not adapter.shares_prefix
        assert not condition_adapter(adapter, "select:3", GEOMETRY).shares_prefix


def test_a_model_with_no_full_attention_layer_is_refused_in_one_line():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=64, **COMMON, num_hidden_layers=2, sliding_window=8,
                                           layer_types=["sliding_attention", "sliding_attention"])
    adapter = HFAdapter(transformers.Gemma3ForCausalLM(config).eval(), "all-sliding")
    with pytest.raises(ValueError, match="no full-attention layer .layers: sliding.: every layer bounds"):
        condition_adapter(adapter, "select:3", GEOMETRY)
    assert condition_adapter(adapter, "none", GEOMETRY) is adapter


def test_static_and_indexed_cache_layers_are_refused_in_one_line():
    from transformers.cache_utils import Cache, DynamicIndexedLayer, StaticLayer

    with pytest.raises(ValueError, match="indexer keys"):
        cache_plan(Cache(layers=[DynamicIndexedLayer()]))
    with pytest.raises(ValueError, match="fixed slots"):
        cache_plan(Cache(layers=[StaticLayer(max_cache_len=8)]))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_audit_command_runs_every_condition_and_records_the_layers(tmp_path, monkeypatch, name):
    from phasekv.auditing import pipeline
    from phasekv.cli import main
    from tests.helpers import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    model_dir = tmp_path / "model"
    build(name, vocab=len(tokenizer), attention="sdpa").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    evaluate = pipeline._evaluate

    def gated(*args, **kwargs):  # a random model is at chance: let it through the capability gate
        run = evaluate(*args, **kwargs)
        run["metrics"]["can_do_task"] = True
        return run

    monkeypatch.setattr(pipeline, "_evaluate", gated)
    conditions = ["none", "select:3+keep-first:1", "mean", "kpool:pool=4,budget=0.25,indexer=oracle"]
    assert main(["audit", "--hf", str(model_dir), "--records", "24", "--demos", "2", "--prompts-per-phase", "1",
                 "--protocol", "prefix", "--compress", *conditions, "--out", str(tmp_path / "audit"),
                 "--no-progress", "--threads", "1"]) == 0
    summary = json.loads((tmp_path / "audit" / "summary.json").read_text())
    kinds = FAMILIES[name][3]
    assert sorted(summary["conditions"]) == sorted(conditions)
    for condition, result in summary["conditions"].items():
        compressed = [] if condition == "none" else [kinds.index("full")]
        assert result["layers"]["compressed"] == compressed and result["layers"]["kinds"] == kinds
        assert 0 <= result["prefix"]["mean_accuracy"] <= 1
    page = (tmp_path / "audit" / "report.html").read_text()
    assert "<h2>Layers</h2>" in page and f"({kinds[0]})" in page


def test_llama4s_chunked_layer_sees_exactly_its_own_chunk_the_grid_its_geometry_names():
    """Phase = position mod C relative to the chunk grid (`archs.llama4`): the chunked layer's output at t depends on
    the tokens floor(t / C) * C .. t and on nothing before; the global layer's does."""
    from phasekv.archs import geometry_of

    model = build("llama4")
    geometry = geometry_of(model)
    assert (geometry.window, geometry.stride, geometry.compressed_layers) == (8, 8, (0,))
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, 20] = (changed[0, 20] + 1) % 64  # position 20: chunk 2 (16 .. 23)
    modules = {i: layer.self_attn for i, layer in enumerate(model.model.layers)}
    _, a = _outputs(None, modules, lambda: model(input_ids=ids))
    _, b = _outputs(None, modules, lambda: model(input_ids=changed))
    moved = (a[0][0] - b[0][0]).abs().amax(-1)[0]  # (T,) chunked layer
    assert torch.equal(moved[:20], torch.zeros(20)) and (moved[20:24] > 0).all()
    assert torch.equal(moved[24:], torch.zeros(16))  # the next chunks never see position 20
    assert ((a[1][0] - b[1][0]).abs().amax(-1)[0, 24:] > 0).all()  # the global layer does


def test_head_masks_with_sinks_equal_their_slow_reference():
    from phasekv.conditions import head_slices as hs

    torch.manual_seed(0)
    state = hs.MaskState(hs.parse_slices("slices:kind=contiguous,size=2,group=query,local=3,sink=1"), "query")
    module = torch.nn.Module()
    module.layer_idx = 0
    q, k, v, sinks = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(4)
    hs._ACTIVE[id(module)] = state
    try:
        fast, _ = hs.masked_attention(module, q, k, v, None, scaling=0.3, s_aux=sinks)
        plain, _ = hs.masked_attention(module, q, k, v, None, scaling=0.3)
    finally:
        hs._ACTIVE.pop(id(module))
    assert torch.allclose(fast, hs.reference_attention(state, module, q, k, v, scaling=0.3, sinks=sinks), atol=1e-5)
    assert torch.allclose(plain, hs.reference_attention(state, module, q, k, v, scaling=0.3), atol=1e-5)
    assert not torch.allclose(fast, plain, atol=1e-3)
