"""Hybrid models under every in-process audit condition (phasekv.conditions.hybrid): tiny configs of transformers'
own classes, one per family (Gemma 3 sliding-window, GPT-OSS alternating sliding/full with learned sinks, Llama 4
chunked + NoPE global, Qwen3-Next linear + full).  Each condition acts on the full-attention layers only, equals a
slow reference there, leaves the other layers' outputs bit-identical to the unconditioned model, and never reads
the future; `phasekv audit` records which layers each condition touched."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from phasekv.adapters.hf import HFAdapter
from phasekv.conditions.grammar import Geometry, condition_adapter
from phasekv.conditions.head_slices import MaskState, masking
from phasekv.conditions.hybrid import cache_plan, layer_bytes, layer_kinds, softmax_with_sinks, touched
from phasekv.conditions.posthoc import cache_bytes, window_starts
from tests.helpers import needs_real

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


needs_kvpress = needs_real(importlib.util.find_spec("kvpress") is not None, "kvpress not installed (make kvpress)")


def _own_masks(family: str, length: int, hidden: torch.Tensor) -> dict:
    """The model's own additive masks (1, 1, T, T) for every layer type but full attention, written out by hand:
    sliding windows of 8 (i - j < 8), Llama 4's chunks of 8 (same chunk), no mask for linear layers."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    def additive(allowed):
        return torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]
    return {"sliding_attention": additive((j <= i) & (i - j < 8)),
            "chunked_attention": additive((j <= i) & (i // 8 == j // 8)),
            "linear_attention": None}


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a is None and b is None


@needs_kvpress
def test_a_press_on_a_hybrid_acts_on_the_full_layers_and_equals_a_masked_forward(family):
    """streaming:sinks=4 keeps the same positions in every head and row (the first 4 and the last ones), so the
    pressed model's query logits must equal one forward over context + queries whose full-attention mask hides the
    dropped context positions from the queries, every other layer type under its own mask."""
    from phasekv.conditions.presses import PressAdapter, kept_positions

    name, adapter = family
    kinds = FAMILIES[name][3]
    context, queries = _inputs()
    press = PressAdapter(adapter, "streaming:sinks=4,ratio=0.5")
    full, _ = adapter.prefill(context)
    past, length = press.prefill(context)
    (pressed_cache,), = [past]
    for index, (layer, kind) in enumerate(zip(pressed_cache.layers, kinds)):
        if kind == "full":
            assert layer.keys.shape[-2] == CONTEXT // 2 and layer.get_seq_length() == CONTEXT
            kept = torch.cat([torch.arange(4), torch.arange(CONTEXT - CONTEXT // 2 + 4, CONTEXT)])
            positions = kept_positions(full.layers[index].keys, layer.keys).sort(-1).values  # a press keeps its order
            assert torch.equal(positions, kept.expand_as(positions))
        else:  # the layers the press leaves hold exactly what the model's own prefill left
            for field in ("keys", "values", "conv_states", "recurrent_states"):
                ours, theirs = getattr(layer, field, None), getattr(full.layers[index], field, None)
                assert _same(ours, theirs), (index, field)
    got = press.continue_from((past, length), queries[:2], 1)
    ids = torch.cat([context, queries[:2]], 1)
    total = ids.shape[1]
    masks = _own_masks(name, total, None)
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    dropped = (j >= 4) & (j < CONTEXT - CONTEXT // 2 + 4) & (i >= CONTEXT)
    masks["full_attention"] = torch.zeros(total, total).masked_fill((j > i) | dropped, float("-inf"))[None, None]
    want = adapter.module(input_ids=ids, attention_mask=masks, use_cache=False).logits[:, CONTEXT:]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert press.kept()["fraction"] == 0.5  # of the full layer's entries only


@needs_kvpress
def test_a_press_refuses_what_it_cannot_do_on_a_hybrid_in_one_line():
    from phasekv.conditions.presses import PressAdapter

    adapter = HFAdapter(build("gemma3"), "gemma3")
    with pytest.raises(ValueError, match="expected-attention re-derives") as error:
        PressAdapter(adapter, "expected-attention:future=8")
    assert len(str(error.value).splitlines()) == 1
    sliding_only = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=64, **COMMON, num_hidden_layers=2, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="no full-attention layer"):
        PressAdapter(HFAdapter(sliding_only, "gemma3"), "knorm")
    sdpa = HFAdapter(build("gpt_oss", attention="sdpa"), "gpt_oss")
    press = PressAdapter(sdpa, "snapkv:window=8")
    with pytest.raises(ValueError, match="eager attention") as error:
        press.prefill(_inputs()[0])
    assert len(str(error.value).splitlines()) == 1


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


def _saved_past_the_gate(name: str, tmp_path, monkeypatch):
    """The family's tiny model saved with a test tokenizer, and the audit's capability gate let through (a random
    model is at chance); returns the model directory."""
    from phasekv.auditing import pipeline
    from tests.helpers import bpe_tokenizer

    tokenizer = bpe_tokenizer()
    model_dir = tmp_path / "model"
    build(name, vocab=len(tokenizer), attention="sdpa").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    evaluate = pipeline._evaluate

    def gated(*args, **kwargs):
        run = evaluate(*args, **kwargs)
        run["metrics"]["can_do_task"] = True
        return run

    monkeypatch.setattr(pipeline, "_evaluate", gated)
    return model_dir


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_audit_command_runs_every_condition_and_records_the_layers(tmp_path, monkeypatch, name):
    from phasekv.cli import main

    model_dir = _saved_past_the_gate(name, tmp_path, monkeypatch)
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


@needs_kvpress
@pytest.mark.parametrize("name", ["gemma3", "qwen3_next"])
def test_the_audit_command_runs_a_press_on_a_hybrid_and_records_the_layers(tmp_path, monkeypatch, name):
    from phasekv.cli import main

    model_dir = _saved_past_the_gate(name, tmp_path, monkeypatch)
    assert main(["audit", "--hf", str(model_dir), "--records", "24", "--demos", "2", "--prompts-per-phase", "1",
                 "--protocol", "prefix", "--compress", "none", "--press", "knorm:ratio=0.5", "--out",
                 str(tmp_path / "audit"), "--no-progress", "--threads", "1"]) == 0
    summary = json.loads((tmp_path / "audit" / "summary.json").read_text())
    kinds = FAMILIES[name][3]
    (press,) = [c for c in summary["conditions"] if c != "none"]
    assert summary["conditions"][press]["layers"]["compressed"] == [kinds.index("full")]


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
