"""phasekv.archs: one home per transformers architecture, checked as a matrix (like COMPRESSOR_MATRIX).

Each ARCH_MATRIX line is a tiny model of transformers' own classes (built from that config class through
`families.build`) with what its architecture file should know about it: the registered architecture, the geometry
of its chunked compression, whether it has an indexer, compressor gates, and gate cycling.  Every line runs through
architecture lookup, geometry (and the phase stride the adapter takes from it), knockout target resolution, cache
repetition for shared prefill, gate statistics, gate cycling and the indexer objective.  (The architectures'
mechanics in depth: test_realarch.py.)"""

from dataclasses import dataclass
from functools import cache

import pytest
import torch

from phasekv import archs, build_model, families
from phasekv.adapters.hf import HFAdapter
from phasekv.adapters.phasekv import adapter_for
from phasekv.archs import CompressionGeometry, Geometry, architecture_of
from phasekv.archs.indexer_kl import distillation, indexers_of
from phasekv.compression import compressors_of
from phasekv.config import TransformersModelConfig
from phasekv.probes.archgates import arch_gate_statistics
from phasekv.probes.cycle import cycle_stride, cycled_gates, cycled_layers, offset_gate_parameters
from phasekv.probes.hooks import capture_final_head_outputs, replace_heads
from tests.helpers import COMPRESSOR_MATRIX, tiny

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
V4 = dict(vocab_size=256, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=2,
          num_experts_per_tok=1, n_shared_experts=1, hc_mult=1, sliding_window=8, partial_rotary_factor=0.25,
          mlp_layer_types=["moe", "moe"], compress_rates={CSA: 4, HCA: 4}, max_position_embeddings=128,
          tie_word_embeddings=False)
INDEXER = dict(index_n_heads=16, index_head_dim=8)  # 16 heads: few heads leave ties at score 0 (test_realarch.py)
MLA = dict(vocab_size=256, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
           num_hidden_layers=2, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8, index_topk=8,
           **INDEXER, max_position_embeddings=128, tie_word_embeddings=False)
M3 = dict(vocab_size=256, hidden_size=32, intermediate_size=64, dense_intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, head_dim=8, index_n_heads=2, index_head_dim=8,
          index_block_size=4, index_topk_blocks=2, index_local_blocks=1, layer_types=["full_attention",
          "minimax_m3_sparse"], mlp_layer_types=["dense", "dense"], num_local_experts=2, num_experts_per_tok=1,
          max_position_embeddings=128, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)


@dataclass
class Arch:
    arch: str  # the registered architecture
    model_type: str
    fields: dict
    geometry: tuple | None = None  # (name, window, stride, compressed layers) of its chunked compression
    indexer: bool = False
    gates: bool = False  # compressor gates the probes read from the real modules
    cycles: bool = False  # gate cycling is defined (W = S)


# one line per supported architecture and configuration that exercises its knowledge
ARCH_MATRIX = {
    "dense-qwen3": Arch("dense", "qwen3", dict(vocab_size=256, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)),
    "deepseek_v4-csa": Arch("deepseek_v4", "deepseek_v4", {**V4, **INDEXER, "index_topk": 3, "layer_types": [CSA] * 2},
                            ("deepseek_v4_csa", 8, 4, [0, 1]), indexer=True, gates=True),
    "deepseek_v4-hca": Arch("deepseek_v4", "deepseek_v4", {**V4, "layer_types": [HCA] * 2},
                            ("deepseek_v4_hca", 4, 4, [0, 1]), gates=True, cycles=True),
    "deepseek_v32": Arch("deepseek_v32", "deepseek_v32", {**MLA, "qk_rope_head_dim": 8, "moe_intermediate_size": 32,
                                                          "n_routed_experts": 2, "num_experts_per_tok": 1, "n_group": 1,
                                                          "topk_group": 1, "n_shared_experts": 1,
                                                          "first_k_dense_replace": 2}, indexer=True),
    "glm5_next": Arch("glm5_next", "glm5_next_text", {**MLA, "qk_rope_head_dim": 0, "index_kpool": 4,
                                                      "index_kpool_always_select_tail": True,
                                                      "layer_types": ["linear_attention", "indexed_attention"],
                                                      "mlp_layer_types": ["dense", "dense"],
                                                      "indexer_types": ["full", "full"], "linear_head_dim": 8,
                                                      "linear_num_heads": 2, "hc_mult": 1, "pad_token_id": None},
                      ("glm5_kpool_indexer", 4, 4, [1]), indexer=True),
    "llama4-chunked": Arch("llama4", "llama4_text", dict(vocab_size=256, hidden_size=32, intermediate_size=64,
                                                         intermediate_size_mlp=64, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                         attention_chunk_size=8, no_rope_layers=[1, 0], moe_layers=[],
                                                         max_position_embeddings=128, tie_word_embeddings=False),
                           ("llama4_chunked_attention", 8, 8, [0])),
    "minimax_m3": Arch("minimax_m3", "minimax_m3_vl_text", {**M3}, ("minimax_m3_block_indexer", 4, 4, [1]),
                       indexer=True),
}
NAMES = sorted(ARCH_MATRIX)


@cache
def built(name: str) -> torch.nn.Module:
    entry = ARCH_MATRIX[name]
    torch.manual_seed(0)
    return families.build(TransformersModelConfig(entry.model_type, dict(entry.fields))).eval()


def ids_for(seed: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_every_registered_architecture_is_in_the_matrix():
    assert {entry.arch for entry in ARCH_MATRIX.values()} == set(archs.available())
    with pytest.raises(ValueError, match="architecture: unknown 'nope'"):
        archs.get("nope")


@pytest.mark.parametrize("name", NAMES)
def test_a_model_and_its_config_find_their_architecture(name):
    model, entry = built(name), ARCH_MATRIX[name]
    assert architecture_of(model).name == entry.arch == architecture_of(model.config).name
    assert architecture_of(model) is archs.get(entry.arch)


def test_phasekv_models_take_the_dense_default():
    model = build_model(tiny(compressor="gated", window=4, stride=4))
    assert architecture_of(model).name == "dense" and archs.geometry_of(model) is None
    attn = model.model.layers[0].self_attn
    assert architecture_of(model).output_projection(attn) is attn.o_proj


@pytest.mark.parametrize("name", NAMES)
def test_geometry_is_read_from_the_config_and_sets_the_phase_stride(name):
    model, expected = built(name), ARCH_MATRIX[name].geometry
    geometry = archs.geometry_of(model)
    if expected is None:
        assert geometry is None and families.compression_geometry(model) is None
        assert adapter_for(model, name).info.stride is None
        return
    assert isinstance(geometry, Geometry) and geometry == CompressionGeometry(*expected[:3], tuple(expected[3]))
    assert families.compression_geometry(model) == {"compressor": expected[0], "window": expected[1],
                                                    "stride": expected[2], "compressed_layers": expected[3]}
    assert adapter_for(model, name).info.stride == expected[2]


@pytest.mark.parametrize("name", sorted(COMPRESSOR_MATRIX))
def test_phasekv_compressors_have_the_same_geometry_interface(name):
    model = build_model(tiny(**COMPRESSOR_MATRIX[name]))
    found = [c for _, c in compressors_of(model)]
    assert found and all(isinstance(c, Geometry) for c in found)


@pytest.mark.parametrize("name", NAMES)
def test_the_knockout_target_is_the_input_of_each_layers_output_projection(name):
    model = built(name)
    adapter, arch = HFAdapter(model, name), architecture_of(model)
    layers = adapter.attention_layers()
    assert len(layers) == adapter.info.num_layers
    for attn in layers:  # a submodule of the layer's attention
        target = arch.output_projection(attn)
        assert target is not None and any(m is target for m in attn.modules())
    ids = ids_for(1)
    with capture_final_head_outputs(adapter) as captured:
        clean = adapter.logits(ids)
    width = adapter.info.num_heads * adapter.info.head_dim
    assert [len(c) for c in captured] == [1] * len(layers)  # one call per forward
    assert all(c[0].shape == (2, width) for c in captured)
    for layer in range(len(layers)):  # replacing the heads' outputs changes the final position only
        with replace_heads(adapter, layer, None, torch.zeros(width)):
            knocked = adapter.logits(ids)
        torch.testing.assert_close(knocked[:, :-1], clean[:, :-1], rtol=0, atol=0)
        assert (knocked[:, -1] - clean[:, -1]).abs().max() > 1e-6


@pytest.mark.parametrize("name", NAMES)
def test_a_prefilled_cache_repeated_per_query_continues_like_full_forwards(name):
    model, n, repeats = built(name), 10, 2
    adapter = HFAdapter(model, name)
    ids = ids_for(2, length=16)
    queries = ids[:, n:].repeat_interleave(repeats, 0)  # context-major: rows 0, 0, 1, 1
    with torch.no_grad():
        full = families.logits(model, torch.cat([ids[:, :n].repeat_interleave(repeats, 0), queries], 1))[:, n:]
    torch.testing.assert_close(adapter.continue_from(adapter.prefill(ids[:, :n]), queries, repeats), full,
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_gate_layers_read_the_geometry_and_pool_every_window(name):
    model, entry = built(name), ARCH_MATRIX[name]
    layers = architecture_of(model).gate_layers(model)
    if not entry.gates:
        assert layers == []
        with pytest.raises(ValueError, match="no compressor gates"):
            arch_gate_statistics(model, ids_for(3))
        return
    _, window, stride, compressed = entry.geometry
    assert [g.layer for g in layers] == compressed
    assert all((g.window, g.stride) == (window, stride) for g in layers)
    gates = arch_gate_statistics(model, ids_for(3), batch_size=1)
    for g in gates:
        assert len(g["profile"]) == window and abs(sum(g["profile"]) - 1) < 1e-6
        assert 1.0 <= g["per_window"] <= g["static"] <= window + 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_gate_cycling_rolls_the_declared_parameters_and_restores_them(name):
    model, entry = built(name), ARCH_MATRIX[name]
    if not entry.cycles:
        with pytest.raises(ValueError, match="gate cycling"):
            cycle_stride(model)
        return
    assert cycle_stride(model) == entry.geometry[2]
    assert [cl.layer for cl in cycled_layers(model)] == entry.geometry[3]
    params = [p for _, p in offset_gate_parameters(model)]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:  # visibly non-uniform gates
            p.copy_(torch.randn_like(p))
    changed = [p.detach().clone() for p in params]
    with cycled_gates(model, 1):
        assert all(torch.equal(p, torch.roll(before, 1, 0)) for p, before in zip(params, changed, strict=True))
    assert all(torch.equal(p, before) for p, before in zip(params, changed, strict=True))
    with torch.no_grad():
        for p, before in zip(params, saved, strict=True):
            p.copy_(before)


@pytest.mark.parametrize("name", NAMES)
def test_the_indexer_objective_records_every_indexer(name):
    model, entry = built(name), ARCH_MATRIX[name]
    found = indexers_of(model)
    assert bool(found) == entry.indexer
    assert all(isinstance(kind, archs.IndexerKind) for *_, kind in found)
    try:
        with distillation(model.train()) as state:
            families.logits(model, ids_for(4))
            records = len(state.records)
            loss = state.loss()
    finally:
        model.eval()
    assert records == len(found)
    assert (loss is None) == (not entry.indexer)
    assert loss is None or (torch.isfinite(loss) and loss.item() >= 0)


def test_archs_imports_nothing_of_phasekv_but_itself():
    from tests.test_foundations import import_graph

    graph = import_graph()
    modules = [m for m in graph if m == "phasekv.archs" or m.startswith("phasekv.archs.")]
    assert len(modules) >= 6
    for module in modules:
        outside = {t for t in graph[module] if not (t == "phasekv.archs" or t.startswith("phasekv.archs."))}
        assert not outside, f"{module} imports {outside}"


def test_a_v32_indexer_narrower_than_its_rotary_dims_is_refused_in_one_line():
    fields = {**ARCH_MATRIX["deepseek_v32"].fields}
    fields["index_head_dim"] = fields["qk_rope_head_dim"] - 1  # transformers builds it and fails in the first forward
    with pytest.raises(ValueError, match=r"^model.index_head_dim: must be >= qk_rope_head_dim=8 .*got 7$"):
        families.build(TransformersModelConfig("deepseek_v32", fields))
    model = families.build(TransformersModelConfig("deepseek_v32", {**fields, "index_head_dim": 8})).eval()
    with torch.no_grad():  # equal widths (no plain indexer dims) run
        assert torch.isfinite(model(ids_for(0)).logits).all()
