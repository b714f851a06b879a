"""A phasekv checkpoint as the subject of a long-context audit (`phasekv audit --checkpoint DIR --context N --family
records`): its word vocabulary renders the set in its training layout (the code directly followed by the value, its
filler as the spacer), the flags that do not apply are one line, and the bundled long-context model
(checkpoints/extra/w8s8-4kv-long, trained at 4,096 tokens) retrieves at the far end of a long context."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from phasekv.data.keyspace import build_key_space
from phasekv.data.longcontext import LongContextSet, LongContextSpec
from phasekv.data.vocab import Vocabulary

LONG = Path(__file__).resolve().parents[1] / "checkpoints" / "extra" / "w8s8-4kv-long"


def test_a_word_vocabulary_renders_the_set_in_its_training_layout():
    vocab = Vocabulary(n_fillers=1)
    keys = build_key_space(vocab)
    assert keys.vocabulary and keys.terminator is None and keys.size(1) == 64 and keys.size(2) == 64 ** 2
    for protocol in ("prefix", "insequence"):
        lset = LongContextSet(LongContextSpec(family="records", context=2048, protocol=protocol, depths=(0.1, 0.9),
                                              n_records=32, key_tokens=1), vocab)
        assert lset.query_tokens == 1 and lset.record_tokens == 2 and lset.n == 32
        assert lset.matching_stats()["exact"] and lset.matching_stats(8)["exact"]
        for prompt in (lset.prompt(0, 0), lset.prompt(lset.n_clusters - 1, 7)):
            ids = prompt.ids
            assert len(ids) == 2048 and ids[0] == vocab.bos and prompt.query_position == 2047
            assert ids[prompt.target_position] == ids[-1] and ids[prompt.target_position + 1] == prompt.answer
            assert set(ids[1:].tolist()) <= set(vocab.group("keys") + vocab.group("values") + vocab.group("fillers"))
            records = np.isin(ids, vocab.group("keys"))
            assert records.sum() == 32 + 1  # every record's key and the query's, nothing else
    with pytest.raises(ValueError, match="the needle family needs prose") as info:
        LongContextSet(LongContextSpec(family="needle", context=2048, n_records=32, key_tokens=1), vocab)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="n_records: 100 distinct keys needed, the key space has 64"):
        LongContextSet(LongContextSpec(family="records", context=2048, n_records=100, key_tokens=1), vocab)


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint", "checkpoints/w8s8-4kv"], "--checkpoint: a phasekv checkpoint compresses in its own layers"),
    (["--checkpoint", "checkpoints/w8s8-4kv", "--context", "512", "--compress", "none", "mean"],
     "audit it on a long-context set"),
    (["--checkpoint", "checkpoints/w8s8-4kv", "--context", "512", "--family", "needle", "--depths", "0.5"],
     "the needle family needs prose"),
])
def test_audit_flags_a_checkpoint_cannot_take_are_one_line(tmp_path, flags, message, capsys):
    from phasekv.cli import main

    code = main(["audit", *flags, "--no-progress", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code != 0 and message in err and not (tmp_path / "o").exists()


@pytest.mark.skipif(not LONG.is_dir(), reason="the bundled long-context checkpoint is absent")
def test_the_bundled_long_context_model_retrieves_at_the_far_end_of_a_long_context():
    """48 prompts at 2,048 tokens, the target among the first records (depth 0.1: 1,600+ tokens before the query):
    the model must beat the copier of a random in-context value (1/32) with a one-sided binomial p below 1e-6."""
    import torch

    from phasekv.auditing.pipeline import checkpoint_subject

    torch.set_num_threads(1)
    spec = LongContextSpec(family="records", context=2048, depths=(0.1,), per_group=64)
    adapter, vocab, spec = checkpoint_subject(LONG, spec)
    assert json.loads((LONG / "config.json").read_text())["data"]["n_records"] == spec.n_records == 32
    lset = LongContextSet(spec, vocab)
    prompts = [lset.prompt(c, s) for c in range(0, 64, 11) for s in range(8)]  # 6 of the 64 clusters, every shift
    hits = 0
    for p in prompts:  # as the audit answers in process: the context prefilled, the query's key continued
        ids = torch.as_tensor(p.ids, dtype=torch.long)[None]
        logits = adapter.continue_from(adapter.prefill(ids[:, :-lset.query_tokens]), ids[:, -lset.query_tokens:], 1)
        hits += int(logits[0, -1].argmax()) == p.answer
    n, p0 = len(prompts), 1 / 32
    assert n == 48 and min(p.query_position - p.target_position for p in prompts) > 1500
    tail = sum(math.comb(n, k) * p0 ** k * (1 - p0) ** (n - k) for k in range(hits, n + 1))
    assert tail < 1e-6, f"{hits}/{n} correct: not above the in-context copier's 1/32"
