"""Mechanistic probes: knockout hooks change only what they should, concentration closed forms,
gate cycling restores the model exactly; everything on tiny models built from config."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from phasekv import ModelConfig, build_model
from phasekv.adapters.hf import HFAdapter
from phasekv.adapters.phasekv import PhaseKVAdapter
from phasekv.checkpoint import save_checkpoint
from phasekv.cli import build_parser
from phasekv.compression.gated import GatedCompressor
from phasekv.data import Vocabulary, build_eval_set
from phasekv.evaluate.runner import predict
from phasekv.probes import (
    Accumulator,
    QueryOnly,
    calibration_set,
    check_disjoint,
    concentration,
    concentration_reference,
    cycled_gates,
    gate_report,
    gate_statistics,
    gate_trajectory,
    heads_of_kv,
    mean_knockout,
    replace_heads,
    run_cycling,
    run_knockout,
)
from phasekv.probes.cycle import averaged_payloads, rolled_payloads
from phasekv.probes.cycle_outcome import r_squared
from phasekv.probes.knockout import accuracies, relative_change

W = 4


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, compressor="gated", window=W, stride=W, local_window=4,
                max_position_embeddings=512)
    return ModelConfig(**{**base, **overrides})


def rig(lm_head: nn.Linear, answer: int) -> None:
    """Every logit 0 but the answer's (w . h): the model is right on about half the prompts, so
    accuracies are neither 0 nor 1 and knockouts move them."""
    with torch.no_grad():
        row = torch.randn(lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0))
        lm_head.weight.zero_()
        lm_head.weight[answer] = row


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary(n_keys=16, n_values=1, n_fillers=8, n_background=8)  # one value word: one answer


@pytest.fixture(scope="module")
def eval_set(vocab):
    return build_eval_set(vocab, "prefix", n_records=12, n_demos=2, stride=W, residue_modulus=8, local_window=4,
                          n_clusters=2)  # 64 prompts of 38 tokens, 16 per phase


def phasekv_adapter(vocab, **overrides) -> PhaseKVAdapter:
    torch.manual_seed(0)
    model = build_model(tiny_config(**overrides))
    rig(model.lm_head, vocab.group("values")[0])
    return PhaseKVAdapter(model)


def hf_adapter(vocab) -> HFAdapter:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config)
    rig(model.lm_head, vocab.group("values")[0])
    return HFAdapter(model, "tiny-qwen3")


def no_hooks_left(module: nn.Module) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in module.modules())


def o_proj_inputs(adapter, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the o_proj input (B, T, H*D) as o_proj receives it (after any pre-hook)."""
    seen, handles = [], []
    for attn in adapter.attention_layers():
        handles.append(attn.o_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].detach().clone())))
    try:
        adapter.logits(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


# ----------------------------------------------------------------------------- knockout


@pytest.mark.parametrize("family", ["phasekv", "hf"])
def test_knockout_changes_only_its_heads_at_the_final_position(family, vocab):
    adapter = phasekv_adapter(vocab) if family == "phasekv" else hf_adapter(vocab)
    info = adapter.info
    ids = torch.randint(0, 64, (3, 21), generator=torch.Generator().manual_seed(1))
    mean = torch.randn(info.num_heads * info.head_dim, generator=torch.Generator().manual_seed(2))
    knocked = torch.cat([torch.arange(h * info.head_dim, (h + 1) * info.head_dim) for h in heads_of_kv(adapter, 1)])
    kept = torch.tensor([d for d in range(mean.numel()) if d not in set(knocked.tolist())])
    assert heads_of_kv(adapter, 1) == [2, 3]  # 4 query heads over 2 KV heads

    clean = o_proj_inputs(adapter, ids)
    with mean_knockout(adapter, 0, 1, mean):
        ko = o_proj_inputs(adapter, ids)
    assert torch.equal(ko[0][:, -1, knocked], mean[knocked].expand(3, -1))  # replaced by the calibration mean
    assert torch.equal(ko[0][:, -1, kept], clean[0][:, -1, kept])  # other heads of the layer untouched
    for layer in range(info.num_layers):
        assert torch.equal(ko[layer][:, :-1], clean[layer][:, :-1])  # every earlier position untouched
    assert not torch.equal(ko[1][:, -1], clean[1][:, -1])  # ... and the knockout does reach the next layer
    assert no_hooks_left(adapter.module)

    with pytest.raises(RuntimeError, match="boom"), mean_knockout(adapter, 1, None, mean):
        raise RuntimeError("boom")
    assert no_hooks_left(adapter.module)
    assert torch.equal(o_proj_inputs(adapter, ids)[1], clean[1])


def test_knockout_acts_on_queries_only_in_multi_query_mode(vocab):
    adapter = phasekv_adapter(vocab)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    mean = 10 * torch.randn(32, generator=torch.Generator().manual_seed(2))
    probe = QueryOnly(adapter)
    with mean_knockout(probe, 0, 0, mean):
        full = probe.logits(ids)[:, -1]
        from_cache = probe.continue_from(probe.prefill(ids[:, :-1]), ids[:, -1:], 1)[:, -1]
    torch.testing.assert_close(from_cache, full, rtol=1e-5, atol=1e-5)
    with mean_knockout(adapter, 0, 0, mean):  # unwrapped: the prefill's last token is knocked out too
        unwrapped = adapter.continue_from(adapter.prefill(ids[:, :-1]), ids[:, -1:], 1)[:, -1]
    assert not torch.allclose(unwrapped, full, atol=1e-3)


def test_knocking_out_nothing_reproduces_the_clean_run_exactly(vocab, eval_set):
    adapter = phasekv_adapter(vocab)
    probe = QueryOnly(adapter)
    clean = predict(probe, eval_set, progress=False)
    with replace_heads(probe, 0, [], torch.zeros(32)):
        nothing = predict(probe, eval_set, progress=False)
    assert nothing == clean
    a, b = accuracies(clean, 4, 8), accuracies(nothing, 4, 8)
    assert 0 < a["accuracy"] < 1 and all(x > 0 for x in a["per_phase"])
    assert relative_change(b["per_phase"], a["per_phase"]) == [0.0] * 4


def test_accuracies_and_relative_change_numbers():
    records = [{"phase": p, "residue": p, "correct": c} for p, c in [(0, 1), (0, 0), (1, 1), (1, 1), (2, 0)]]
    acc = accuracies(records, stride=4, residue_modulus=4)
    assert acc["per_phase"] == [0.5, 1.0, 0.0, None] and acc["accuracy"] == 0.6
    assert relative_change([0.25, 0.5, 0.1, None], acc["per_phase"]) == [-50.0, -50.0, None, None]


def test_calibration_set_is_disjoint_and_checked(eval_set):
    calib = calibration_set(eval_set, n_prompts=20)
    assert len(calib.queries()) >= 20 and calib.settings["seed"] == eval_set.settings["seed"] + 1
    assert calib.prompt_length == eval_set.prompt_length
    check_disjoint(eval_set, calib)
    with pytest.raises(ValueError, match="also occur in the eval set"):
        check_disjoint(eval_set, eval_set)
    with pytest.raises(ValueError, match="must differ"):
        calibration_set(eval_set, seed=eval_set.settings["seed"])


@pytest.mark.parametrize("family, whole_layer", [("hf", False), ("phasekv", True)])
def test_run_knockout_writes_the_map(family, whole_layer, vocab, eval_set, tmp_path):
    adapter = phasekv_adapter(vocab) if family == "phasekv" else hf_adapter(vocab)
    calib = calibration_set(eval_set, n_prompts=16)
    result = run_knockout(adapter, eval_set, calib, tmp_path, whole_layer=whole_layer, progress=False)
    heads = [None] if whole_layer else [0, 1]
    assert [(r["layer"], r["kv_head"]) for r in result["rows"]] == [(l, h) for l in range(2) for h in heads]
    for row in result["rows"]:
        assert len(row["per_phase_rel_change_pct"]) == 4 and len(row["per_residue_rel_change_pct"]) == 8
        expected = [100 * (k - c) / c for k, c in zip(row["per_phase"], result["clean"]["per_phase"])]
        assert row["per_phase_rel_change_pct"] == pytest.approx(expected)
        for acc, ci in zip(row["per_phase"], row["per_phase_ci"]):  # cluster bootstrap intervals
            assert ci is not None and ci[0] - 1e-9 <= acc <= ci[1] + 1e-9
        rel = row["mean_rel_change_ci_pct"]
        assert rel is None or rel[0] <= rel[1]
    assert any(abs(v) > 0 for r in result["rows"] for v in r["per_phase_rel_change_pct"])
    assert json.loads((tmp_path / "knockout.json").read_text())["rows"] == result["rows"]
    assert (tmp_path / "knockout.png").stat().st_size > 0 and result["heatmap"] == "knockout.png"
    assert no_hooks_left(adapter.module)


# ----------------------------------------------------------------------------- gate concentration


def one_hot(index: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(index, width).double()


@pytest.mark.parametrize("name, alpha, expected", [
    ("one-hot", one_hot(torch.full((12,), 2), W), (1.0, 1.0)),
    ("uniform", torch.full((12, W), 1 / W, dtype=torch.float64), (W, W)),
    ("input-dependent one-hot", one_hot(torch.arange(12) % W, W), (W, 1.0)),
    ("vector: one-hot channel + uniform channel",
     torch.stack([one_hot(torch.full((12,), 1), W), torch.full((12, W), 1 / W, dtype=torch.float64)], -1),
     ((1 + W) / 2, (1 + W) / 2)),
])
def test_concentration_closed_forms(name, alpha, expected):
    assert concentration(alpha) == pytest.approx(expected, abs=1e-12)
    assert concentration_reference(alpha) == pytest.approx(expected, abs=1e-12)
    streamed = Accumulator().add(alpha[:5]).add(alpha[5:])
    assert streamed.concentration() == pytest.approx(expected, abs=1e-12)


def test_concentration_matches_reference_on_random_alpha():
    alpha = torch.softmax(3 * torch.randn(50, 6, 3, generator=torch.Generator().manual_seed(0)), dim=1)
    assert concentration(alpha) == pytest.approx(concentration_reference(alpha), rel=1e-10)
    static, per_window = concentration(alpha)
    assert 1 < per_window < static < 6  # input-dependent gates sit below the diagonal


def test_constructed_compressor_gates_have_closed_form_concentration():
    config = tiny_config(num_key_value_heads=1, gate_bias=True)
    compressor = GatedCompressor(config.options("gated"), config)
    h = torch.zeros(1, 12 * W, 32)  # 12 windows
    marker = torch.arange(12) * W + torch.arange(12) % W  # one marked token per window, offset j mod W
    h[0, marker, 0] = 1.0
    cases = {"uniform": (0.0, 0.0, (W, W)), "one-hot": (0.0, 60.0, (1.0, 1.0)),
             "input-dependent one-hot": (60.0, 0.0, (W, 1.0))}
    for name, (z_scale, b_scale, expected) in cases.items():
        with torch.no_grad():
            compressor.k_gate.zero_()
            compressor.k_gate[:, 0] = z_scale  # logit z_scale on the marked token, every offset alike
            compressor.k_gate_bias.zero_()
            compressor.k_gate_bias[2] = b_scale  # offset 2 preferred whatever the input
        alpha = compressor.gate_weights(h)["k"][0, :, :, 0]  # (N, W, G)
        assert concentration(alpha) == pytest.approx(expected, abs=1e-6), name


def test_gate_report_on_models(vocab, eval_set, tmp_path):
    ids = torch.tensor([p.ids for p in eval_set.prompts()[:6]])
    uniform = gate_statistics(phasekv_adapter(vocab, uniform=True), ids, progress=False)
    assert len(uniform) == 2 * 2 * 2  # layers x KV heads x branches
    assert all(g["kind"] == "uniform" and (g["static"], g["per_window"]) == pytest.approx((W, W)) for g in uniform)

    adapter = phasekv_adapter(vocab, gate="vector")
    with torch.no_grad():
        adapter.module.model.layers[1].self_attn.compressor.v_gate_bias[1] = 80.0  # one-hot at offset 1
    result = gate_report(adapter.module, [ids[:4], ids[4:, :20]], tmp_path, top=2, progress=False)
    gate = next(g for g in result["gates"] if (g["layer"], g["branch"]) == (1, "v"))
    assert (gate["static"], gate["per_window"]) == pytest.approx((1.0, 1.0), abs=1e-6)
    assert gate["profile"] == pytest.approx([0, 1, 0, 0], abs=1e-6)
    assert gate["n_windows"] == 4 * (38 // W) + 2 * (20 // W)
    assert "per channel" in result["note"]
    assert json.loads((tmp_path / "gates.json").read_text())["gates"] == result["gates"]
    for name in ("concentration_plane.png", "gate_profiles.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert no_hooks_left(adapter.module)
    with pytest.raises(ValueError, match="no compressed layer"):
        gate_statistics(build_model(tiny_config(compressor="none")), ids, progress=False)


def test_gate_trajectory_reads_the_snapshots(vocab, tmp_path):
    torch.manual_seed(0)
    config = tiny_config()
    model = build_model(config)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="no snapshots"):
        gate_trajectory(run, ids, tmp_path / "out")
    save_checkpoint(run / "checkpoints" / "step_000010", model, {"model": config.to_dict()})
    (run / "latest").write_text("step_000010\n")
    (run / "config.json").write_text(json.dumps({"model": config.to_dict()}))
    (run / "gates").mkdir()
    final = {n: p.detach().clone() for n, p in model.named_parameters() if ".compressor." in n}
    early = {n: torch.zeros_like(p) if "_gate" in n else p for n, p in final.items()}  # uniform gates at step 5
    save_file(early, str(run / "gates" / "step_000005.safetensors"))
    save_file(final, str(run / "gates" / "step_000010.safetensors"))
    result = gate_trajectory(run, ids, tmp_path / "out", progress=False)
    assert result["steps"] == [5, 10]
    now = gate_statistics(model, ids, progress=False)
    for g, ref in zip(result["gates"], now, strict=True):
        assert g["static"][0] == pytest.approx(W) and g["per_window"][0] == pytest.approx(W)
        assert g["static"][1] == pytest.approx(ref["static"]) and g["per_window"][1] == pytest.approx(ref["per_window"])
    assert (tmp_path / "out" / "gate_trajectory.png").stat().st_size > 0


# ----------------------------------------------------------------------------- gate cycling


def test_cycling_rolls_gates_only_and_restores_bit_for_bit(vocab):
    adapter = phasekv_adapter(vocab)
    with torch.no_grad():
        for name, p in adapter.module.named_parameters():
            if "_gate_bias" in name:
                p.normal_()
    before = {k: v.clone() for k, v in adapter.module.state_dict().items()}
    compressor = adapter.module.model.layers[0].self_attn.compressor
    with cycled_gates(adapter, 1):
        for branch in ("k", "v"):
            for name in (f"{branch}_gate", f"{branch}_gate_bias"):
                original = before[f"model.layers.0.self_attn.compressor.{name}"]
                assert torch.equal(getattr(compressor, name), original[[(i - 1) % W for i in range(W)]])
            assert torch.equal(getattr(compressor, f"{branch}_payload"),
                               before[f"model.layers.0.self_attn.compressor.{branch}_payload"])
    for delta in (1, 2, 3, -3):
        with cycled_gates(adapter, delta), cycled_gates(adapter, -delta):
            state = adapter.module.state_dict()
            assert all(torch.equal(state[k], v) for k, v in before.items())
    with pytest.raises(RuntimeError, match="boom"), cycled_gates(adapter, 2):
        raise RuntimeError("boom")
    state = adapter.module.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())


def test_cycling_controls_roll_or_average_the_payloads_and_restore(vocab, eval_set):
    """Control 1 rolls payload maps with the gates; control 2 gives every offset the gate-weighted average
    map; both restore every parameter bit for bit; a shared-payload model has no per-offset maps to move."""
    adapter = phasekv_adapter(vocab)
    before = {k: v.clone() for k, v in adapter.module.state_dict().items()}
    c = adapter.module.model.layers[0].self_attn.compressor
    with rolled_payloads(adapter, 2):
        assert torch.equal(c.k_payload, torch.roll(before["model.layers.0.self_attn.compressor.k_payload"], 2, 0))
        assert torch.equal(c.v_gate, torch.roll(before["model.layers.0.self_attn.compressor.v_gate"], 2, 0))
    gates = gate_statistics(adapter, torch.tensor([p.ids for p in eval_set.prompts()[:8]]), progress=False)
    with averaged_payloads(adapter, gates):
        maps = c.k_payload.view(W, c.k_payload.shape[1], c.num_kv_heads, -1)
        assert all(torch.allclose(maps[i], maps[0]) for i in range(W))
        key = next(g for g in gates if (g["layer"], g["branch"], g["kv_head"]) == (0, "k", 1))
        profile = torch.tensor(key["profile"])
        original = before["model.layers.0.self_attn.compressor.k_payload"].view_as(maps)[:, :, 1]
        torch.testing.assert_close(maps[0, :, 1], torch.einsum("w,wcd->cd", profile / profile.sum(), original))
    state = adapter.module.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())
    shared = phasekv_adapter(vocab, payload="shared")
    assert shared.module.model.layers[0].self_attn.compressor.k_payload.shape[0] == 1
    result = run_cycling(shared, eval_set, deltas=[0], progress=False)
    assert "controls" not in result and result["deltas"][0]["matches_clean"]


def test_cycling_reports_intervals_and_controls(vocab, eval_set):
    result = run_cycling(phasekv_adapter(vocab), eval_set, deltas=[-3, 0, 1], progress=False, n_boot=200)
    rolled = result["controls"]["rolled_payloads"]["deltas"]
    averaged = result["controls"]["averaged_payloads"]
    # controls skip delta 0 (the clean model) and shifts beyond 2
    assert [r["delta"] for r in rolled] == [r["delta"] for r in averaged["deltas"]] == [1]
    assert len(averaged["clean"]["per_phase"]) == len(result["clean"]["per_phase"])
    for row in result["deltas"] + rolled:
        ci = row["r2_excl_boundary_ci"]
        assert ci is None or ci[0] <= ci[1] <= 1.0


def test_cycling_by_zero_reproduces_the_clean_evaluation(vocab, eval_set, tmp_path):
    adapter = phasekv_adapter(vocab)
    clean = predict(adapter, eval_set, progress=False)
    with cycled_gates(adapter, 0):
        assert predict(adapter, eval_set, progress=False) == clean
    result = run_cycling(adapter, eval_set, deltas=[0, 1], out_dir=tmp_path, progress=False)
    zero, one = result["deltas"]
    assert zero["matches_clean"] and zero["observed"] == result["clean"]["per_phase"] == zero["predicted"]
    assert zero["mae"] == 0.0
    assert one["predicted"] == [zero["observed"][(r - 1) % W] for r in range(W)]
    assert json.loads((tmp_path / "cycling.json").read_text())["deltas"] == result["deltas"]
    assert (tmp_path / "cycling.png").stat().st_size > 0


def test_r_squared():
    import numpy as np

    x = np.array([0.1, 0.5, 0.9])
    assert r_squared(x, x) == 1.0 and r_squared(x, np.full(3, 0.5)) == 0.0
    assert r_squared(np.full(3, 0.5), x) is None


@pytest.mark.parametrize("overrides, message", [
    (dict(window=8, stride=4), "W = S"),
    (dict(compressor="none"), "no compressed layer"),
    (dict(uniform=True), "nothing to cycle"),
])
def test_cycling_refuses_undefined_cases(overrides, message, vocab):
    with pytest.raises(ValueError, match=message), cycled_gates(phasekv_adapter(vocab, **overrides), 1):
        pass


# ----------------------------------------------------------------------------- command line


def test_cli_runs_the_probes_on_a_checkpoint(vocab, tmp_path):
    torch.manual_seed(0)
    config = tiny_config()
    model = build_model(config)
    rig(model.lm_head, vocab.group("values")[0])
    save_checkpoint(tmp_path / "ckpt", model, {"model": config.to_dict(), "vocab": vocab.to_dict(),
                                               "data": {"n_records": 12}})
    parser = build_parser()  # the `phasekv` command as registered: one module per probe subcommand
    common = ["--checkpoint", str(tmp_path / "ckpt"), "--records", "12", "--demos", "2", "--residue-modulus", "8",
              "--clusters", "2", "--local-window", "4", "--no-progress"]
    for command, extra in (("knockout", ["--calib-prompts", "16"]), ("gates", ["--prompts", "8"]),
                           ("cycle", ["--deltas", "-1", "0", "1"])):
        args = parser.parse_args([command, *common, "--out", str(tmp_path / command), *extra])
        result = args.func(args)
        assert result and any((tmp_path / command).glob("*.png"))
    assert [d["delta"] for d in result["deltas"]] == [-1, 0, 1]
    args = parser.parse_args(["grid", *common, "--out", str(tmp_path / "grid")])
    result = args.func(args)
    assert len(result["per_shift"]) == 4 and (tmp_path / "grid" / "grid_shifts.json").is_file()
    args = parser.parse_args(["knockout", *common, "--out", str(tmp_path / "x"), "--calib-prompts", "0"])
    with pytest.raises(ValueError, match="--calib-prompts"):
        args.func(args)


def test_grid_shifts_average_the_shifted_curves_and_restore_the_grid(vocab, eval_set, tmp_path):
    from phasekv.compression import compressors_of
    from phasekv.probes.grid import run_grid_shifts

    adapter = phasekv_adapter(vocab)
    clean = accuracies(predict(adapter, eval_set, 16, True, False), eval_set.stride, eval_set.residue_modulus)
    result = run_grid_shifts(adapter, eval_set, tmp_path, batch_size=16, progress=False)
    assert [c.offset for _, c in compressors_of(adapter.module)] == [0] * len(compressors_of(adapter.module))
    assert [r["shift"] for r in result["per_shift"]] == list(range(eval_set.stride))
    assert result["per_shift"][0]["per_phase"] == clean["per_phase"] == result["fixed"]["per_phase"]
    curves = np.array([r["per_phase"] for r in result["per_shift"]])
    assert np.allclose(result["randomized"]["per_phase"], curves.mean(0))
    assert any(r["per_phase"] != clean["per_phase"] for r in result["per_shift"][1:])  # the shifts act
    assert (tmp_path / "grid_shifts.json").is_file()


def test_phase_bootstrap_refuses_an_empty_record_set_in_one_line():
    """An evaluation with no prompts has nothing to resample: one clear error, not numpy's on an empty array."""
    from phasekv.evaluate.profiles import phase_bootstrap

    with pytest.raises(ValueError, match="no records to resample"):
        phase_bootstrap([[]], stride=4, n_boot=10)
    with pytest.raises(ValueError, match="no records to resample"):
        phase_bootstrap([], stride=4, n_boot=10)
    records = [{"cluster": c, "phase": c % 4, "correct": c % 2} for c in range(8)]
    assert phase_bootstrap([records], stride=4, n_boot=10).shape == (10, 1, 4)
