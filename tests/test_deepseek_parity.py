"""Parity of phasekv's `deepseek_csa` compressor with transformers' `DeepseekV4CSACompressor` (DeepSeek-V4 CSA).

With phasekv's maps set from transformers' weights (payload / gate maps per block half, per-offset gate bias from
`position_bias`) and the same RMSNorm, phasekv's entry j equals transformers' entry j + 1 to 1e-5.  Each difference
that remains is pinned by a test here:

  * transformers emits one more entry, first: entry 0 gates only block 0's current-block series (a window of m
    tokens, the missing previous block has weight 0); phasekv's first entry needs 2m tokens.
  * RoPE position of an entry: transformers rotates entry w at w * m, the first token of its current block (window
    start + m); phasekv rotates an entry at its window start.  transformers' RoPE pairs interleaved channels on the
    last rope dims at `compress_rope_theta`; phasekv's `Rotary` is its own convention and theta.
  * the norm: transformers' compressor has its own RMSNorm (`kv_norm`); phasekv applies the layer's k_norm, shared
    with the raw keys.
  * visibility agrees: both let query t read the entry covering tokens up to e once t >= e.
"""

import pytest
import torch

from phasekv.compression import build as build_compressor
from tests.helpers import tiny

transformers_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

M, HIDDEN, D = 4, 32, 16


def pair(seed: int = 0):
    """(transformers' CSA compressor with random weights, phasekv's deepseek_csa with the same maps)."""
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(hidden_size=HIDDEN, head_dim=D, num_attention_heads=2, q_lora_rank=16,
                              index_n_heads=2, index_head_dim=8, partial_rotary_factor=0.5,
                              layer_types=["compressed_sparse_attention"], num_hidden_layers=1, vocab_size=64)
    torch.manual_seed(seed)
    theirs = transformers_v4.DeepseekV4CSACompressor(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours = build_compressor(tiny(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=D,
                                 compressor="deepseek_csa", csa_block=M), "deepseek_csa")
    with torch.no_grad():
        kv, gate, bias = theirs.kv_proj.weight, theirs.gate_proj.weight, theirs.position_bias  # (2D, hidden), (m, 2D)
        ours.k_payload.copy_(torch.stack([kv[:D].T, kv[D:].T]))  # previous block: series Ca; current block: Cb
        ours.k_gate.copy_(torch.stack([gate[:D].T, gate[D:].T]))
        ours.k_gate_bias.copy_(torch.cat([bias[:, :D], bias[:, D:]]))  # offsets 0..m-1: Ca, m..2m-1: Cb
    return theirs, ours


def transformers_entries(theirs, h: torch.Tensor):
    """transformers' entries (B, n, D) after its RMSNorm, before RoPE, and after RoPE."""
    seen = {}
    handle = theirs.kv_norm.register_forward_hook(lambda m, a, out: seen.update(normed=out))
    try:
        positions = torch.arange(h.shape[1])[None]
        rotated, _ = theirs(h, h[..., :16], positions, None, 0)
    finally:
        handle.remove()
    return seen["normed"], rotated[:, 0]


def test_entries_match_from_the_second_transformers_entry_on():
    theirs, ours = pair()
    h = torch.randn(2, 22, HIDDEN)
    normed, _ = transformers_entries(theirs, h)
    ek, ev = ours.compress(h)  # (B, N, 1, D), pre-norm
    assert ev is None and ek.shape[1] == 4 and normed.shape[1] == 22 // M == 5
    torch.testing.assert_close(theirs.kv_norm(ek[:, :, 0]), normed[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.compress_reference(h)[0], ek, rtol=1e-5, atol=1e-5)


def test_transformers_first_entry_is_a_half_window():
    theirs, _ = pair(1)
    h = torch.randn(1, 8, HIDDEN)
    normed, _ = transformers_entries(theirs, h)
    cb = (h[0, :M] @ theirs.kv_proj.weight[D:].T)  # current-block series of block 0 (m, D)
    alpha = (h[0, :M] @ theirs.gate_proj.weight[D:].T + theirs.position_bias[:, D:]).softmax(0)
    torch.testing.assert_close(normed[0, 0], theirs.kv_norm((alpha * cb).sum(0)), rtol=1e-5, atol=1e-5)


def test_transformers_rotates_an_entry_at_its_current_block_start_not_its_window_start():
    theirs, _ = pair(2)
    h = torch.randn(1, 16, HIDDEN)
    normed, rotated = transformers_entries(theirs, h)
    n = normed.shape[1]
    current_block = torch.arange(n) * M  # entry w covers tokens (w-1)m .. (w+1)m-1
    for positions, equal in ((current_block, True), ((current_block - M).clamp(min=0), False)):
        cos, sin = theirs.rotary_emb(normed, position_ids=positions[None], layer_type="compress")
        expect = transformers_v4.apply_rotary_pos_emb(normed.unsqueeze(1), cos, sin).squeeze(1)
        assert torch.allclose(expect, rotated, atol=1e-6) == equal


def test_both_show_an_entry_once_its_last_token_is_read():
    theirs, ours = pair(3)
    T = 20
    h = torch.randn(1, T, HIDDEN)
    _, bias = theirs(h, h[..., :16], torch.arange(T)[None], None, 0)  # (1, 1, T, n): 0 visible, -inf not
    w, t = torch.arange(bias.shape[-1]), torch.arange(T)[:, None]
    torch.testing.assert_close(bias[0, 0] == 0, (w + 1) * M - 1 <= t)  # entry w's last token is (w + 1) m - 1
    last = ours.window_starts(T) + ours.window - 1  # phasekv's entry j is transformers' entry j + 1
    torch.testing.assert_close(last, (torch.arange(len(last)) + 2) * M - 1)
