"""transformers' own sparse-attention architectures through phasekv, at toy size: DeepSeek-V4 (CSA, m=4, lightning
indexer over compressed entries), DeepSeek-V3.2 (token-level DSA) and GLM-5.3 (k-pool DSA, pools of 4).

Each is built from its preset under configs/transformers/ shrunk to the smallest sizes, and checked through the real
classes: no future leakage (training forward and cached evaluation), prefill + continuation equals a full forward,
the indexer distillation (phasekv.archs.indexer_kl) trains the indexer and leaves the LM gradients bit-identical, and
`phasekv train` / `load_checkpoint` / `phasekv eval --checkpoint` work end to end."""

import json
from pathlib import Path

import pytest
import torch
import yaml

import phasekv
from phasekv import families
from phasekv.adapters.hf import HFAdapter
from phasekv.archs import architecture_of
from phasekv.archs.indexer_kl import distillation, indexer_parameters, indexers_of
from phasekv.config import Experiment, TransformersModelConfig
from phasekv.training.loop import clip_groups, token_losses

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "transformers"
# The presets at the smallest sizes that keep every mechanism (selection below the candidates included).  The indexer
# keeps 16 heads: its score sums ReLU(q . k) over heads, and with few heads many candidates score exactly 0, so the
# top-k breaks ties by tensor layout and a cached continuation selects differently from a full forward (measured with
# 2 heads on DeepSeek-V3.2: logits differ by 2e-2; with 16 heads no candidate scores 0 and they agree exactly).
SMALL = {
    "deepseek-v4-csa": dict(hidden_size=32, num_attention_heads=2, head_dim=16, q_lora_rank=16, o_lora_rank=8,
                            moe_intermediate_size=32, index_n_heads=16, index_head_dim=8, index_topk=3,
                            sliding_window=8, partial_rotary_factor=0.25, max_position_embeddings=128),
    "deepseek-v32-dsa": dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                             kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                             index_topk=8, index_n_heads=16, index_head_dim=8, max_position_embeddings=128),
    "glm5-kpool": dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                       kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8, index_topk=8,
                       index_n_heads=16, index_head_dim=8, linear_head_dim=8, linear_num_heads=2,
                       max_position_embeddings=128),
}
NAMES = list(SMALL)
EXPECTED = {"deepseek-v4-csa": "DeepseekV4ForCausalLM", "deepseek-v32-dsa": "DeepseekV32ForCausalLM",
            "glm5-kpool": "TextCausalLM"}


def small_section(name: str) -> dict:
    section = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["model"]
    return {**section, **SMALL[name]}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    section = small_section(name)
    torch.manual_seed(seed)
    return families.build(TransformersModelConfig(section.pop("model_type"), section))


def ids_for(seed: int, batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return token_losses(model, ids, labels) / labels.ne(-100).sum()


@pytest.mark.parametrize("name", NAMES)
def test_no_future_leakage_and_cached_continuation_equals_full_forward(name):
    model = build(name)
    assert type(model).__name__ == EXPECTED[name] and indexers_of(model)
    ids, n = ids_for(1), 21  # prefill length not a multiple of the pool / compression size
    adapter = HFAdapter(model, name)
    with torch.no_grad():
        full = families.logits(model.train(), ids)
    cached = adapter.continue_from(adapter.prefill(ids[:, :n]), ids[:, n:], 1)
    torch.testing.assert_close(cached, full[:, n:], rtol=0, atol=1e-4)
    for p in (2, 22, 31):
        changed = ids.clone()
        changed[:, p] = (changed[:, p] + 1) % 256
        with torch.no_grad():
            out = families.logits(model.train(), changed)
        torch.testing.assert_close(out[:, :p], full[:, :p], rtol=0, atol=1e-5)
        assert (out[:, p:] - full[:, p:]).abs().max() > 1e-4  # the change is seen from p on
        if p >= n:
            cont = adapter.continue_from(adapter.prefill(changed[:, :n]), changed[:, n:], 1)
            torch.testing.assert_close(cont[:, :p - n], cached[:, :p - n], rtol=0, atol=1e-5)
            torch.testing.assert_close(cont, out[:, n:], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_one_prefill_repeated_per_query_equals_full_forwards(name):
    """The architecture's `repeat_cache` repeats every state of the cache (compressor buffers, linear-attention
    states)."""
    model = build(name).eval()
    ids, n, repeats = ids_for(2), 22, 3
    queries = torch.cat([ids[:, n:]] * repeats, dim=0)[torch.arange(2 * repeats).view(repeats, 2).T.flatten()]
    contexts = ids[:, :n].repeat_interleave(repeats, 0)
    with torch.no_grad():
        full = families.logits(model, torch.cat([contexts, queries], dim=1))[:, n:]
        past, length = HFAdapter(model, name).prefill(ids[:, :n])
        architecture_of(model).repeat_cache(past, 2, repeats)
        positions = torch.arange(length, ids.shape[1]).expand(queries.shape[0], -1)
        out = model(input_ids=queries, position_ids=positions, cache=past, use_cache=True).logits
    torch.testing.assert_close(out, full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_indexer_loss_reaches_only_the_indexer_and_selection_matches_the_real_scores(name):
    model = build(name).train()
    ids = ids_for(3, batch=3)
    own = {id(p) for p in indexer_parameters(model)}
    lm_loss(model, ids).backward()
    assert own and all(p.grad is None for p in indexer_parameters(model))  # why the indexer needs its own loss
    lm_only = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with distillation(model) as state:
        lm = lm_loss(model, ids)
        aux = state.loss(keep=True)
        records = list(state.records.values())
    (lm + aux).backward()
    assert aux.item() > 0 and len(records) == len(indexers_of(model))
    for n, p in model.named_parameters():
        if id(p) in own:
            continue
        assert (p.grad is None) == (n not in lm_only), n
        assert p.grad is None or torch.equal(p.grad, lm_only[n]), n  # bit-identical LM gradients
    assert all(p.grad is not None for p in indexer_parameters(model))
    assert len(clip_groups(model)) == 2
    for record in records:  # the recorded scores rank the candidates as the real indexer selected them
        assert record.used.sum() > 0 and (record.candidates & ~record.selected).sum() > 0  # selection matters
        scores = record.scores.detach()
        low = torch.where(record.used, scores, float("inf")).amin(-1)
        high = torch.where(record.candidates & ~record.selected, scores, float("-inf")).amax(-1)
        assert (low >= high - 1e-5).all()


@pytest.mark.parametrize("name", NAMES)
def test_indexer_loss_decreases(name):
    model = build(name).train()
    with torch.no_grad():  # peaked main attention (a random LM's is near uniform: nothing to distill)
        for attention, _, _ in indexers_of(model):
            attention.q_b_proj.weight.mul_(30.0)
    ids = ids_for(4, batch=4)
    optimizer = torch.optim.Adam(indexer_parameters(model), lr=3e-2)
    losses = []
    for _ in range(10):
        with distillation(model) as state:
            families.logits(model, ids)
            aux = state.loss()
        optimizer.zero_grad()
        aux.backward()
        optimizer.step()
        losses.append(aux.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_trains_saves_loads_and_evaluates(name, tmp_path):
    from phasekv.cli import main
    from phasekv.training.loop import train
    from phasekv.training.rundir import read_metrics
    from tests.test_train import TINY

    tree = {**TINY, "model": small_section(name), "train": {**TINY["train"], "steps": 3, "checkpoint_every": 3}}
    train(Experiment.from_tree(tree), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    assert rows and all("indexer_loss" in row for row in rows)
    model, _ = phasekv.load_checkpoint(tmp_path / "run")
    assert type(model).__name__ == EXPECTED[name] and not model.training
    flags = ["--clusters", "2", "--records", "24", "--demos", "4", "--no-progress", "--seed", "3", "--one-by-one"]
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "eval"), *flags]) == 0
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["n_prompts"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_dense_warmup_selects_every_candidate_and_restores_the_top_k(name):
    from phasekv.archs.indexer_kl import dense_selection

    model = build(name).train()
    before = [module.index_topk for _, module, _ in indexers_of(model)]
    ids = ids_for(5, batch=2)
    with dense_selection(model, ids.shape[1]) as changed, distillation(model) as state:
        families.logits(model, ids)
        records = list(state.records.values())
    assert changed == len(before) and records
    for record in records:  # every causal candidate selected: the main attention is dense
        assert record.candidates.any() and not (record.candidates & ~record.selected).any()
    assert [module.index_topk for _, module, _ in indexers_of(model)] == before
    with dense_selection(model, ids.shape[1], on=False) as changed:
        assert changed == 0


@pytest.mark.parametrize("name", ["deepseek-v4-csa", "deepseek-v32-dsa"])
def test_knockout_hooks_act_on_the_real_output_projection_at_the_final_position_only(name):
    from phasekv.probes.hooks import capture_final_head_outputs, replace_heads

    model = build(name).eval()
    adapter = HFAdapter(model, name)
    ids = ids_for(6, batch=2, length=24)
    with capture_final_head_outputs(adapter) as captured:
        clean = adapter.logits(ids)
    info = adapter.info
    assert all(c[0].shape == (2, info.num_heads * info.head_dim) for c in captured)
    for layer in range(info.num_layers):
        own = captured[layer][0][0]  # prompt 0's own head outputs: a no-op for prompt 0, a change for prompt 1
        with replace_heads(adapter, layer, list(range(info.num_heads)), own):
            knocked = adapter.logits(ids)
        torch.testing.assert_close(knocked[:, :-1], clean[:, :-1], rtol=0, atol=0)
        torch.testing.assert_close(knocked[0], clean[0], rtol=1e-5, atol=1e-5)
        assert (knocked[1, -1] - clean[1, -1]).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_v4_gate_statistics_recompute_the_real_compressor(kind):
    """HCA (windows of m' = 4) and CSA (windows of 2m = 8 every m = 4, two series per token): the gate softmax
    recomputed from the module's weights rebuilds the module's own entries (CSA: entries 1.., whose previous
    window exists), and the statistics pool every such window."""
    from phasekv.archs.deepseek_v4 import compressors, gate_weights, windows
    from phasekv.probes.archgates import arch_gate_statistics

    section = small_section("deepseek-v4-csa")
    if kind == "hca":
        for key in ("index_n_heads", "index_head_dim", "index_topk"):
            section.pop(key)
    layer_type = {"hca": "heavily_compressed_attention", "csa": "compressed_sparse_attention"}[kind]
    section.update(layer_types=[layer_type] * 2,
                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4})
    torch.manual_seed(0)
    model = families.build(TransformersModelConfig(section.pop("model_type"), section)).eval()
    W = 4 if kind == "hca" else 8
    assert families.compression_geometry(model) == {"compressor": f"deepseek_v4_{kind}", "window": W, "stride": 4,
                                                    "compressed_layers": [0, 1]}
    found = compressors(model)
    assert [i for i, _ in found] == [0, 1]
    with torch.no_grad():  # visibly non-uniform gates
        for _, c in found:
            c.position_bias.normal_(0, 2.0)
    seen = []
    hooks = [c.register_forward_hook(lambda m, a, k, out, c=c: seen.append((c, a[0] if a else k["hidden_states"],
                                                                            out[0])), with_kwargs=True)
             for _, c in found]
    ids = ids_for(7, batch=2, length=40)
    with torch.no_grad():
        families.logits(model, ids)
    for h in hooks:
        h.remove()
    rope = int(model.config.head_dim * model.config.partial_rotary_factor)
    assert len(seen) == 2
    for c, hidden, entries in seen:  # entries (B, 1, N, D): our alpha rebuilds the module's own entries
        alpha = gate_weights(c, hidden)
        assert alpha.shape[1:3] == ((10, 4) if kind == "hca" else (9, 8))
        torch.testing.assert_close(alpha.sum(2), torch.ones_like(alpha.sum(2)))
        payload = windows(c, c.kv_proj(hidden))
        rebuilt = c.kv_norm((payload * alpha.to(payload.dtype)).sum(2))
        first = 0 if kind == "hca" else 1  # CSA entry 0 has no previous window
        torch.testing.assert_close(rebuilt[..., :-rope], entries[:, 0, first:, :-rope], rtol=1e-5, atol=1e-5)
    gates = arch_gate_statistics(model, ids, batch_size=1)
    assert [g["layer"] for g in gates] == [0, 1]
    for g in gates:
        assert len(g["profile"]) == W and 1.0 <= g["per_window"] <= g["static"] <= W + 1e-9
        assert g["n_windows"] == 2 * (40 // 4 - (kind == "csa")) and abs(sum(g["profile"]) - 1) < 1e-6
        assert g["window"] == W and g["offset_phases"] == [j % 4 for j in range(W)]


def test_v4_gate_cycling_rolls_position_bias_of_hca_and_refuses_csa():
    """transformers' DeepSeek-V4 HCA compressor is cyclable through its per-offset position_bias (W = S = m',
    boundary phase m' - 1), restored bit for bit; CSA (W = 2m, S = m) is refused like any W != S compressor."""
    from phasekv.archs.deepseek_v4 import compressors
    from phasekv.probes.cycle import boundary_phases, cycle_stride, cycled_gates, offset_gate_parameters

    for layer_type, rate in (("heavily_compressed_attention", 8), ("compressed_sparse_attention", 4)):
        section = small_section("deepseek-v4-csa")
        if layer_type == "heavily_compressed_attention":
            for key in ("index_n_heads", "index_head_dim", "index_topk"):
                section.pop(key)
        section.update(layer_types=[layer_type] * 2,
                       compress_rates={"compressed_sparse_attention": rate, "heavily_compressed_attention": rate})
        torch.manual_seed(0)
        model = families.build(TransformersModelConfig(section.pop("model_type"), section)).eval()
        if layer_type == "compressed_sparse_attention":
            with pytest.raises(ValueError, match="needs W = S"):
                cycle_stride(model)
            continue
        assert cycle_stride(model) == 8 and boundary_phases(model) == [7]
        biases = [c.position_bias for _, c in compressors(model)]
        assert [p for _, p in offset_gate_parameters(model)] == biases
        with torch.no_grad():
            for p in biases:
                p.normal_()
        saved = [p.detach().clone() for p in biases]
        with cycled_gates(model, 3):
            for p, before in zip(biases, saved, strict=True):
                assert torch.equal(p, torch.roll(before, 3, 0))
        assert all(torch.equal(p, before) for p, before in zip(biases, saved, strict=True))


def test_knockout_of_a_layer_with_its_own_head_count_is_whole_layer(tmp_path):
    """GLM-5.3 with a one-head linear-attention layer (its o_proj takes 8 dims, the MLA layer 2 heads x 8): the
    knockout replaces that layer whole and the MLA layer per KV head; per-head replacement of the narrow layer is
    refused in one line."""
    from phasekv.data import Vocabulary, build_eval_set
    from phasekv.probes import calibration_set, replace_heads, run_knockout

    section = {**small_section("glm5-kpool"), "linear_num_heads": 1}
    torch.manual_seed(0)
    adapter = HFAdapter(families.build(TransformersModelConfig(section.pop("model_type"), section)).eval(), "glm")
    vocab = Vocabulary(n_keys=16, n_values=4, n_fillers=8, n_background=8)
    eval_set = build_eval_set(vocab, "prefix", n_records=8, n_demos=2, stride=4, residue_modulus=4, local_window=4,
                              n_clusters=2)
    result = run_knockout(adapter, eval_set, calibration_set(eval_set, n_prompts=8), tmp_path, progress=False)
    assert [(r["layer"], r["kv_head"]) for r in result["rows"]] == [(0, None), (1, 0), (1, 1)]
    assert (tmp_path / "knockout.png").stat().st_size > 0
    with pytest.raises(ValueError, match="knock out the whole layer"), replace_heads(adapter, 0, [1], torch.zeros(8)):
        pass
