"""Evaluation prompt sets of the two padding protocols and the query-phase protocol (phasekv.data.protocols)."""

from collections import Counter, defaultdict

import pytest

from phasekv.data import PROTOCOLS, Vocabulary, build_eval_set
from phasekv.data.protocols import query_length_offset

R = 24


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary()


@pytest.fixture(scope="module", params=PROTOCOLS)
def eval_set(request, vocab):
    return build_eval_set(vocab, request.param, n_records=32, n_demos=8, stride=8)


def _moments(positions):
    """Exact (n, n * sum, n^2 * variance) of a list of integers: equal tuples <=> equal mean and variance."""
    n, s1, s2 = len(positions), sum(positions), sum(p * p for p in positions)
    return n, s1, n * s2 - s1 * s1


@pytest.mark.parametrize("S", [4, 6, 8, 12])
def test_target_position_moments_are_equal_in_every_group(eval_set, S):
    groups = defaultdict(list)
    for q in eval_set.queries():
        groups[q.target_position % R].append(q.target_position)
        assert q.residue == q.target_position % R and q.phase == q.target_position % 8
    assert sorted(groups) == list(range(R))
    assert len({_moments(g) for g in groups.values()}) == 1  # same n, mean and variance, exactly
    assert len(groups[0]) == 576
    stats = eval_set.matching_stats(S)
    assert stats["max_mean_gap"] == 0.0 and stats["max_variance_rel_gap"] == 0.0
    assert [g["n"] for g in stats["per_group"]] == [576 * R // S] * S
    assert stats["per_group"][0]["variance"] > 300  # targets spread over the records, not bunched


def test_every_pair_is_shown_at_every_shift_once(eval_set):
    positions = defaultdict(list)
    for q in eval_set.queries():
        positions[(q.cluster, q.record)].append((q.shift, q.target_position))
    assert len(positions) == 576
    for shows in positions.values():
        shifts, pos = zip(*sorted(shows))
        assert shifts == tuple(range(R))
        assert [p - s for s, p in shows] == [pos[0]] * R  # position = base + shift


def test_shifts_of_a_cluster_differ_only_in_where_the_fillers_sit(eval_set, vocab):
    fillers = set(vocab.group("fillers"))
    by_cluster = defaultdict(set)
    for c in eval_set.contexts:
        words = tuple(t for t in c.ids if t not in fillers)
        filler_words = tuple(t for t in c.ids if t in fillers)
        by_cluster[c.cluster].add((words, filler_words, tuple(c.demo_records)))
    assert len(by_cluster) == len(eval_set.contexts) // R
    assert all(len(v) == 1 for v in by_cluster.values())


def test_fixed_query_position_and_answers(eval_set, vocab):
    length = eval_set.prompt_length
    assert eval_set.query_position == length - 1
    assert {len(c.ids) for c in eval_set.contexts} == {length - 1}
    prompts = eval_set.prompts()
    assert len(prompts) == 576 * R and {len(p.ids) for p in prompts} == {length}
    assert {q.query_position for q in eval_set.queries()} == {eval_set.query_position}
    for p in prompts[:: 97]:
        q = p.query
        assert p.ids[-1] == q.key[0] == p.ids[q.target_position]
        assert p.ids[q.target_position + 1] == q.answer and vocab.group_of(q.answer) == "values"
        assert p.ids == eval_set.contexts[p.context].ids + list(q.key)


def test_targets_outside_local_window_and_demos_are_other_records(eval_set):
    lw = eval_set.local_window
    for c in eval_set.contexts:
        targets = {q.record for q in c.queries}
        assert len(targets) == len(c.queries) == (12 if eval_set.protocol == "prefix" else 8)
        assert not targets & set(c.demo_records) and len(set(c.demo_records)) == 8
        for q in c.queries:
            assert q.target_position + 1 <= eval_set.query_position - lw
        demo_keys = {c.ids[p] for p in range(eval_set.prompt_length - 1 - 16, eval_set.prompt_length - 1, 2)}
        assert not demo_keys & {q.key[0] for q in c.queries}


def test_prompt_is_a_training_sequence(eval_set, vocab):
    """<bos>, fillers and distinct-key records, fillers, queries repeating records, then the target key."""
    kinds = {g: set(vocab.group(g)) for g in ("keys", "values", "fillers")}
    c = eval_set.contexts[5]
    ids = c.ids + list(c.queries[0].key)
    assert ids[0] == vocab.bos
    words = [t for t in ids[1:] if t not in kinds["fillers"]]
    records, queries = words[:64], words[64:]
    assert all(records[i] in kinds["keys"] and records[i + 1] in kinds["values"] for i in range(0, 64, 2))
    table = dict(zip(records[::2], records[1::2]))
    assert len(table) == 32
    assert all(table[queries[i]] == queries[i + 1] for i in range(0, 16, 2)) and queries[16] in table
    tail = ids[c.record_positions[-1] + 2:]
    assert all(t not in kinds["fillers"] for t in tail[-17:])  # demonstrations and target are contiguous


def test_insequence_moves_distractors_prefix_does_not(eval_set):
    offsets = defaultdict(set)
    for c in eval_set.contexts:
        targets = {q.record for q in c.queries}
        for q in c.queries:
            for j in (q.record - 1, q.record + 1):
                if 0 <= j < len(c.record_positions) and j not in targets:
                    offsets[(c.cluster, q.record, j)].add(c.record_positions[j] - q.target_position)
    varying = sum(len(v) > 1 for v in offsets.values()) / len(offsets)
    if eval_set.protocol == "prefix":
        assert varying == 0.0
    else:
        assert varying == 1.0
        assert sum(len(v) for v in offsets.values()) / len(offsets) > 3  # several distinct offsets each


def test_deterministic_in_seed(vocab):
    a = build_eval_set(vocab, "insequence", n_records=32, n_clusters=3, seed=4)
    b = build_eval_set(vocab, "insequence", n_records=32, n_clusters=3, seed=4)
    c = build_eval_set(vocab, "insequence", n_records=32, n_clusters=3, seed=5)
    assert [x.ids for x in a.contexts] == [x.ids for x in b.contexts]
    assert [x.ids for x in a.contexts] != [x.ids for x in c.contexts]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_small_sets_keep_means_exact_and_variances_within_bound(vocab, protocol):
    g = 2 if protocol == "prefix" else 3
    for per_family in (1, 4):
        s = build_eval_set(vocab, protocol, n_records=32, n_clusters=g * per_family)
        stats = s.matching_stats()
        variances = [x["variance"] for x in stats["per_group"]]
        assert stats["max_mean_gap"] == 0.0 and not s.settings["exact_matching"]
        assert max(variances) - min(variances) <= 2 * R / per_family  # K = per_family pairs per residue
    assert stats["max_variance_rel_gap"] < 0.025


def test_multi_token_records_match_exactly(vocab):
    s = build_eval_set(vocab, "prefix", n_records=32, key_tokens=2, value_tokens=2, stride=4)
    stats = s.matching_stats()
    assert stats["max_mean_gap"] == 0.0 and stats["max_variance_rel_gap"] == 0.0
    q = s.queries()[0]
    prompt = s.prompts()[0].ids
    assert len(q.key) == 2 and prompt[-2:] == list(q.key) == prompt[q.target_position:q.target_position + 2]
    assert prompt[q.target_position + 2] == q.answer


def test_bad_configurations_raise(vocab):
    with pytest.raises(ValueError, match="residue_modulus"):
        build_eval_set(vocab, "prefix", stride=5)
    with pytest.raises(ValueError, match="'prefix', 'insequence'"):
        build_eval_set(vocab, "suffix")
    with pytest.raises(ValueError, match="n_clusters"):
        build_eval_set(vocab, "prefix", n_clusters=3)
    with pytest.raises(ValueError, match="targets_per_context"):
        build_eval_set(vocab, "prefix", targets_per_context=5)
    with pytest.raises(ValueError, match="insequence_gap"):
        build_eval_set(vocab, "insequence", insequence_gap=0)
    with pytest.raises(ValueError, match="local window"):  # no record can clear a 200-token window
        build_eval_set(vocab, "prefix", n_records=32, local_window=200)


def test_describe_is_readable(eval_set, vocab):
    text = eval_set.describe(3)
    head, body = text.split("\n")
    q = eval_set.queries()[3]
    assert f"position {q.target_position}" in head and f"residue {q.residue} mod 24" in head
    assert body.endswith(f"{vocab.decode(q.key)} -> {vocab.decode([q.answer])}")
    assert f"[{vocab.decode(q.key)} {vocab.decode([q.answer])}]" in body
    assert body.startswith("<bos>") and "<pad>" not in body


# ---------------------------------------------------------------------------------------------- the query protocol


@pytest.fixture(scope="module")
def query_set(vocab):
    return build_eval_set(vocab, "query", n_records=32, n_demos=8, stride=8)


def test_query_protocol_holds_every_target_fixed_and_moves_the_query(query_set):
    positions, shifts = defaultdict(set), defaultdict(list)
    top = query_set.query_position  # the longest prompt's
    for c in query_set.contexts:
        e = query_length_offset(c.cluster, 2, 8)
        for q in c.queries:
            positions[(q.cluster, q.record)].add(q.target_position)
            shifts[(q.cluster, q.record)].append(q.shift)
            assert q.query_position == len(c.ids) + len(q.key) - 1 == top - (R - 1) - (8 - 1) + e + q.shift
            assert q.residue == q.target_position % R and q.phase == q.target_position % 8
            assert q.target_position + 1 <= q.query_position - query_set.local_window  # outside at every shift
    assert len(positions) == 576 and all(len(p) == 1 for p in positions.values())  # fixed target, every shift
    assert all(sorted(s) == list(range(R)) for s in shifts.values())
    assert Counter(q.query_position % 8 for q in query_set.queries()) == dict.fromkeys(range(8), 576 * 3)
    prefix = build_eval_set(query_set.vocab, "prefix", n_records=32, stride=8).prompt_length
    assert query_set.prompt_length == prefix + 8 - 1  # the offsets e <= S - 1 add to the longest prompt


def test_query_shifts_insert_one_filler_between_the_records_and_the_demonstrations(query_set, vocab):
    fillers = set(vocab.group("fillers"))
    by_cluster = defaultdict(dict)
    for c in query_set.contexts:
        by_cluster[c.cluster][c.shift] = c
    assert len(by_cluster) == 48
    for cluster in (0, 1, 47):  # both families
        shown = by_cluster[cluster]
        for s in range(R - 1):
            a, b = shown[s].ids, shown[s + 1].ids
            at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            assert len(b) == len(a) + 1 and b[:at] + b[at + 1:] == a and b[at] in fillers
            assert at > shown[s].record_positions[-1] + 1  # after the last record
            assert all(t not in fillers for t in a[at:])  # right before the demonstrations
            assert shown[s].record_positions == shown[s + 1].record_positions
            assert shown[s].demo_records == shown[s + 1].demo_records


def test_every_query_phase_holds_every_shift_and_offset_equally_often(query_set):
    """The crossed design: a query-phase group is not one shift.  Every (query phase, shift) and every (query phase,
    length offset) cell holds the same number of prompts, so any effect of the shift (depth, fillers after the
    records) is the same in every phase group."""
    queries = query_set.queries()
    assert query_set.settings["crossed"] and query_set.settings["n_clusters"] == 48
    by_shift = Counter((q.query_position % 8, q.shift) for q in queries)
    assert len(by_shift) == 8 * R and set(by_shift.values()) == {len(queries) // (8 * R)}
    by_offset = Counter((q.query_position % 8, query_length_offset(q.cluster, 2, 8)) for q in queries)
    assert len(by_offset) == 64 and set(by_offset.values()) == {len(queries) // 64}


def test_query_phase_groups_have_equal_mean_length_and_the_same_targets(query_set):
    by_query = query_set.matching_stats(8, coordinate="query")
    assert by_query["max_mean_gap"] == 0.0  # the same targets at the same positions in every phase group
    means = {g["mean_query_position"] for g in by_query["per_group"]}
    low = query_set.query_position - (R - 1) - (8 - 1)
    assert means == {low + (8 - 1) + (R - 8) / 2}  # a linear length trend cancels exactly (protocols docstring)
    assert query_set.settings["exact_matching"] and query_set.settings["insequence_gap"] == 0
    with pytest.raises(ValueError, match="coordinate"):
        query_set.matching_stats(coordinate="answer")


def test_too_few_clusters_for_the_crossing_are_flagged(vocab):
    s = build_eval_set(vocab, "query", n_records=32, n_demos=8, stride=8, n_clusters=6)
    assert not s.settings["crossed"]
    assert build_eval_set(vocab, "prefix", n_records=32, stride=8).settings.get("crossed") is None


def test_query_protocol_with_needle_pitch_and_few_clusters(vocab):
    s = build_eval_set(vocab, "query", n_records=32, n_demos=4, stride=4, residue_modulus=4, n_clusters=4,
                       key_tokens=2, value_tokens=2)
    queries = s.queries()
    assert Counter(q.query_position % 4 for q in queries) == dict.fromkeys(range(4), len(queries) // 4)
    prompts = s.prompts()
    assert all(p.ids[p.query.target_position:p.query.target_position + 2] == list(p.query.key) == p.ids[-2:]
               and p.ids[p.query.target_position + 2] == p.query.answer for p in prompts)
    assert "query at position" in s.describe(0) and f"position {queries[0].query_position}" in s.describe(0)


def _post_fillers(context, n_demos):
    """Fillers between the last record and the first demonstration (1-token keys and values)."""
    return len(context.ids) - 2 * n_demos - (context.record_positions[-1] + 2)


def test_prefix_balances_post_fillers_per_group_but_ties_them_to_the_residue_within_a_record(vocab):
    """What prefix padding can and cannot balance (module docstring, "What prefix padding cannot balance"): the
    fillers after the records have the same mean in every residue group, but for one record the residue fixes
    their number (up to the 0 / 24 wrap), so a model whose retrieval of some records depends on them shows a
    residue pattern (docs/notes/full1kv.md)."""
    eval_set = build_eval_set(vocab, "prefix", n_records=32, n_demos=8, stride=8)
    by_group, by_record_residue = defaultdict(list), defaultdict(set)
    for context in eval_set.contexts:
        post = _post_fillers(context, 8)
        assert post == 24 - (context.record_positions[0] - 1)  # lead + post = the 24 fillers of every prompt
        for q in context.queries:
            by_group[q.residue].append(post)
            by_record_residue[(q.record, q.residue)].add(post)
    assert len({(len(g), sum(g)) for g in by_group.values()}) == 1  # equal sizes and sums: equal means, exactly
    assert all(max(v) - min(v) in (0, 24) for v in by_record_residue.values())
    assert len({frozenset(v) for (i, _), v in by_record_residue.items() if i == 31}) > 1  # it varies with r


def test_a_query_design_with_r_equal_to_s_spans_three_stride_cycles(vocab):
    """Where the shifts alone span fewer than three cycles (the audit's R = S), the length offsets run over 3 S:
    the lengths span R + 3 S - 1 tokens, still crossed (48 clusters: 24 per family) and with equal mean lengths."""
    s = build_eval_set(vocab, "query", n_records=24, n_demos=4, stride=8, residue_modulus=8, n_clusters=48)
    assert s.settings["length_offsets"] == 24 and s.settings["crossed"]
    lengths = {q.query_position for q in s.queries()}
    assert max(lengths) - min(lengths) + 1 == 8 + 24 - 1
    by_query = s.matching_stats(8, coordinate="query")
    assert len({g["mean_query_position"] for g in by_query["per_group"]}) == 1
    cells = Counter((q.query_position % 8, q.shift) for q in s.queries())
    assert len(cells) == 64 and len(set(cells.values())) == 1
