"""Vocabulary, lookup training examples and the training stream (phasekv.data.vocab / lookup)."""

import json

import numpy as np
import pytest
import torch

from phasekv.config import DataConfig
from phasekv.data import IGNORE, TrainingStream, Vocabulary


@pytest.fixture(scope="module")
def stream():
    cfg = DataConfig()
    return TrainingStream(Vocabulary.from_data_config(cfg), cfg, seed=7)


# ----------------------------------------------------------------------------- vocabulary


def test_vocabulary_groups_and_round_trip():
    vocab = Vocabulary()
    sizes = {name: len(vocab.group(name)) for name in ("specials", "keys", "values", "fillers", "background")}
    assert sizes == {"specials": 2, "keys": 64, "values": 64, "fillers": 16, "background": 64}
    assert vocab.size == 210 <= 256
    ids = [i for name in sizes for i in vocab.group(name)]
    assert ids == list(range(vocab.size))  # contiguous groups, every id in exactly one group
    assert vocab.group_of(vocab.group("values")[3]) == "values"
    text = vocab.decode(range(vocab.size))
    assert all(w.replace("-", "").isalpha() or w in ("<bos>", "<pad>") for w in text.split(" "))
    assert vocab.encode(text) == list(range(vocab.size))
    assert vocab.encode(["cat", "Alice", "um"]) == vocab.encode("cat Alice um")
    assert vocab.decode(vocab.encode("<bos> otter Bob so the")) == "<bos> otter Bob so the"
    restored = Vocabulary.from_dict(json.loads(json.dumps(vocab.to_dict())))
    assert restored == vocab and restored.words == vocab.words


def test_vocabulary_generates_readable_compounds_and_validates():
    big = Vocabulary(n_keys=300, n_values=100, n_fillers=40, n_background=200)
    keys = [big.words[i] for i in big.group("keys")]
    assert len(set(keys)) == 300 and keys[0] == "cat" and keys[-1].count("-") == 1
    assert all(part.isalpha() for w in keys for part in w.split("-"))
    assert Vocabulary(n_keys=300, n_values=100, n_fillers=40, n_background=200).words == big.words
    with pytest.raises(ValueError, match="n_keys"):
        Vocabulary(n_keys=0)
    with pytest.raises(ValueError, match="unknown word 'unicorn'"):
        big.encode("cat unicorn")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        big.decode([big.size])


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("field, value", [("n_records", 0), ("prefix_max", -1), ("background_fraction", 1.5),
                                          ("key_tokens", 1.0), ("background_successors", 65),
                                          ("n_records", 65), ("n_records", 4)])
def test_data_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DataConfig(**{field: value})


def test_sequences_have_equal_length_and_begin_with_bos(stream):
    cfg = stream.config
    assert cfg.seq_len == 1 + 23 + 23 + 0 + (32 + 32) * 2 == 175
    ids, labels = stream.batch(0, 16)
    assert ids.shape == labels.shape == (16, 175) and ids.dtype == labels.dtype == torch.long
    assert (ids[:, 0] == stream.vocab.bos).all()
    assert (labels[:, -1] == IGNORE).all()


# ----------------------------------------------------------------------------- determinism and sharding


def test_batches_are_a_pure_function_of_seed_step_rank(stream):
    a = stream.batch(5, 8)
    stream.batch(0, 8)
    assert all(torch.equal(x, y) for x, y in zip(a, stream.batch(5, 8)))
    again = TrainingStream(stream.vocab, stream.config, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a, again.batch(5, 8)))
    other_seed = TrainingStream(stream.vocab, stream.config, seed=8).batch(5, 8)
    assert not torch.equal(a[0], other_seed[0])
    assert not torch.equal(a[0], stream.batch(6, 8)[0])


def test_rank_shards_union_to_the_single_process_batch(stream):
    ranks = [TrainingStream(stream.vocab, stream.config, seed=7, rank=r, world_size=2) for r in (0, 1)]
    for step in (0, 3):
        single = stream.batch(step, 8)
        parts = [r.batch(step, 4) for r in ranks]
        assert not torch.equal(parts[0][0], parts[1][0])
        for k in range(2):
            assert torch.equal(single[k], torch.cat([parts[0][k], parts[1][k]]))


# ----------------------------------------------------------------------------- lookup examples


def _first_occurrence(ids):
    first = {}
    for pos, tok in enumerate(ids):
        first.setdefault(tok, pos)
    return first


def test_supervised_labels_are_record_values_outside_the_local_window(stream):
    keys = set(stream.vocab.group("keys"))
    lw = stream.config.local_window
    counts = {"supervised": 0, "in_window": 0}
    for index in range(120):
        e = stream.example(index)
        if e.kind != "lookup":
            continue
        ids = e.ids.tolist()
        first = _first_occurrence(ids)
        latest = {}
        for t, tok in enumerate(ids):
            if tok in keys and first[tok] != t:  # a query key (records hold distinct keys)
                inside = latest[tok] + 1 > t - lw  # the latest earlier copy ends one token after its key
                assert e.labels[t] == (IGNORE if inside else ids[first[tok] + 1])
                assert e.answer_mask[t] == (not inside)
                counts["in_window" if inside else "supervised"] += 1
            else:
                assert e.labels[t] == IGNORE and not e.answer_mask[t]
            if tok in keys:
                latest[tok] = t
    assert counts["supervised"] > 1000 and counts["in_window"] > 100  # both branches of the rule exercised


def test_multi_token_records_supervise_every_value_token():
    cfg = DataConfig(key_tokens=2, value_tokens=3, n_records=20, n_queries=10, prefix_max=5, outer_max=2,
                     gap_fillers=7, background_fraction=0.0)
    s = TrainingStream(Vocabulary.from_data_config(cfg), cfg, seed=1)
    e = s.example(0)
    assert len(e.ids) == cfg.seq_len == 1 + 5 + 2 + 7 + 30 * 5
    labelled = set(np.flatnonzero(e.labels != IGNORE).tolist())
    expected = set()
    for start, record, ok in zip(e.query_positions, e.query_records, e.supervised):
        r = e.record_positions[record]
        assert e.ids[start:start + 2].tolist() == e.ids[r:r + 2].tolist()
        if ok:
            assert e.labels[start + 1:start + 4].tolist() == e.ids[r + 2:r + 5].tolist()
            assert e.answer_mask[start + 1]
            expected |= {start + 1, start + 2, start + 3}
    assert labelled == expected and e.answer_mask.sum() == sum(e.supervised) > 0
    gaps = np.diff(e.record_positions) - 5
    assert gaps.sum() == 7 and (gaps >= 0).all()


def test_prefix_lengths_are_uniform_over_residues(stream):
    fillers = set(stream.vocab.group("fillers"))
    prefixes = []
    for index in range(1600):
        e = stream.example(index)
        if e.kind == "lookup":
            p = e.prefix
            assert all(t in fillers for t in e.ids[1:1 + p]) and e.record_positions[0] == 1 + p
            prefixes.append(p)
    assert min(prefixes) == 0 and max(prefixes) == 23
    critical = {24: 49.73, 12: 31.26, 8: 24.32, 6: 20.52, 4: 16.27}  # chi-square, p = 0.001, modulus - 1 dof
    for modulus, limit in critical.items():  # residues mod 24 and the record phases mod S
        counts = np.bincount(np.asarray(prefixes) % modulus, minlength=modulus)
        expected = len(prefixes) / modulus
        assert ((counts - expected) ** 2 / expected).sum() < limit


# ----------------------------------------------------------------------------- background and validation


def test_background_examples_walk_the_chain(stream):
    background = stream.vocab.group("background")
    kinds = [stream.example(i).kind for i in range(2000)]
    frac = kinds.count("background") / len(kinds)
    assert abs(frac - 0.25) < 4 * np.sqrt(0.25 * 0.75 / 2000)
    e = next(stream.example(i) for i in range(50) if kinds[i] == "background")
    states = e.ids[1:] - background[0]
    assert e.ids[0] == stream.vocab.bos and states.min() >= 0 and states.max() < 64
    for a, b in zip(states[:-1], states[1:]):
        assert b in stream.chain.successors[a]
    assert np.array_equal(e.labels[:-1], e.ids[1:]) and e.labels[-1] == IGNORE and not e.answer_mask.any()
    rate = stream.chain.entropy_rate()
    assert 0 < rate < np.log(4)  # 4 successors at most


def test_validation_set_is_fixed_and_held_out(stream):
    batches = stream.validation_set(40, batch_size=16)
    assert [b.input_ids.shape[0] for b in batches] == [16, 16, 8]
    again = stream.validation_set(40, batch_size=16)
    assert all(torch.equal(x, y) for a, b in zip(batches, again) for x, y in zip(a, b))
    assert not torch.equal(batches[0].input_ids, stream.batch(0, 16)[0])
    ids, labels, answer = batches[0]
    assert answer.dtype == torch.bool and answer.sum() > 50
    assert (labels[answer] != IGNORE).all()
    assert torch.isin(labels[answer], torch.tensor(stream.vocab.group("values"))).all()
    other = stream.validation_set(16, seed=3, batch_size=16)[0]
    assert not torch.equal(other.input_ids, ids)


def test_curriculum_ramps_records_and_keeps_lengths():

    cfg = DataConfig(n_records=32, curriculum_start=8, curriculum_examples=100, background_fraction=0.0)
    stream = TrainingStream(Vocabulary(), cfg, seed=0)
    assert [stream.records_at(i) for i in (0, 50, 99, 100, 10_000)] == [8, 20, 31, 32, 32]
    early, late = stream.example(0), stream.example(500)
    assert len(early.record_positions) == 8 and len(late.record_positions) == 32
    assert len(early.ids) == len(late.ids) == cfg.seq_len
    assert max(early.query_records) < 8
    with pytest.raises(ValueError, match="curriculum_start"):
        DataConfig(n_records=32, curriculum_start=40, curriculum_examples=10)


def test_repeat_examples_train_induction_at_varying_distances():
    cfg = DataConfig(n_records=32, n_queries=32, outer_max=0, background_fraction=0.0, repeat_fraction=0.5)
    stream = TrainingStream(Vocabulary(), cfg, seed=3)
    examples = [stream.example(i) for i in range(200)]
    repeats = [e for e in examples if e.kind == "repeat"]
    assert 70 < len(repeats) < 130 and all(len(e.ids) == cfg.seq_len for e in examples)
    distances = set()
    for e in repeats:
        t = np.flatnonzero(e.labels != IGNORE)
        m = t[0] - 1  # the second copy starts at m + 1; its first token is not supervised
        assert m > cfg.local_window and (t == np.arange(m + 1, 2 * m)).all()
        assert (e.labels[t] == e.ids[t + 1]).all() and (e.ids[t + 1] == e.ids[t + 1 - m]).all()
        assert not e.answer_mask.any()  # lookup accuracy is measured on lookup answers only
        distances.add(int(m))
    assert len(distances) > 20  # a fixed distance would be solved by a positional head, not by induction
    plain = TrainingStream(Vocabulary(), DataConfig(n_records=32, n_queries=32, outer_max=0, background_fraction=0.0),
                           seed=3)
    assert all(plain.example(i).kind == "lookup" for i in range(50))
