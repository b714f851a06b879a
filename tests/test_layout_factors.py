"""research/layout_factors.py: each variant changes only the layout factor it names, and on the bundled full-1kv
the prefix residue pattern goes when the fillers after the records go (docs/notes/full1kv.md)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phasekv.data import Vocabulary, build_eval_set

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "research" / "layout_factors.py"


@pytest.fixture(scope="module")
def factors():
    spec = importlib.util.spec_from_file_location("layout_factors", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary()


@pytest.fixture(scope="module")
def prefix(vocab):
    return build_eval_set(vocab, "prefix", n_records=32, n_demos=8, stride=8, n_clusters=2)


def _non_fillers(ids, vocab):
    fillers = set(vocab.group("fillers"))
    return [t for t in ids if t not in fillers]


def test_prefix_variant_reproduces_the_protocol(factors, prefix):
    same, counts = factors.relayout(prefix, "prefix")
    assert [c.ids for c in same.contexts] == [c.ids for c in prefix.contexts]
    assert same.queries() == prefix.queries()
    assert all(lead + post == 24 and mid == 0 for lead, post, mid in counts)


def test_no_post_and_mid_keep_the_targets_and_drop_the_fillers_after_the_records(factors, prefix, vocab):
    for variant in ("no-post", "mid"):
        moved, counts = factors.relayout(prefix, variant)
        assert [q.target_position for q in moved.queries()] == [q.target_position for q in prefix.queries()]
        for c, old in zip(moved.contexts, prefix.contexts, strict=True):
            assert c.ids[c.record_positions[-1] + 2:][:16] == old.ids[-16:]  # demonstrations follow the records
            assert _non_fillers(c.ids, vocab) == _non_fillers(old.ids, vocab)
        assert all(post == 0 for _, post, _ in counts)
    mid, _ = factors.relayout(prefix, "mid")
    assert {q.query_position for q in mid.queries()} == {prefix.query_position}  # the query stays put
    no_post, _ = factors.relayout(prefix, "no-post")
    assert len({q.query_position for q in no_post.queries()}) == 25  # the query moves with the lead


def test_filler_variants_change_only_the_filler_words(factors, prefix, vocab):
    for variant in ("random", "one-filler"):
        changed, _ = factors.relayout(prefix, variant)
        assert changed.queries() == prefix.queries()
        assert all(_non_fillers(c.ids, vocab) == _non_fillers(o.ids, vocab)
                   for c, o in zip(changed.contexts, prefix.contexts, strict=True))
        assert any(c.ids != o.ids for c, o in zip(changed.contexts, prefix.contexts, strict=True))


def test_bad_inputs_raise(factors, prefix, vocab):
    with pytest.raises(ValueError, match="variant"):
        factors.relayout(prefix, "sideways")
    with pytest.raises(ValueError, match="prefix set"):
        factors.relayout(build_eval_set(vocab, "insequence", n_records=32, n_demos=8, n_clusters=3), "prefix")


def test_full_1kv_pattern_goes_with_the_fillers_after_the_records():
    out = subprocess.run([sys.executable, str(SCRIPT), str(ROOT / "checkpoints" / "full-1kv"), "--variants",
                          "prefix,no-post", "--n-boot", "200"], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    bounds = {line.split()[0]: [float(x) for x in re.search(r"crossfit +\S+ \[(\S+), (\S+)\]", line).groups()]
              for line in out.splitlines() if "crossfit" in line}
    assert bounds["prefix"][0] > 5  # a residue gap under prefix padding
    assert bounds["no-post"][1] < 5  # none with the same targets and no fillers after the records


def test_post_only_and_lead_fixed_hold_every_target_and_vary_only_the_post_fillers(factors, prefix):
    for variant, extra in (("post-only", 0), ("lead-fixed", 12)):
        held, counts = factors.relayout(prefix, variant)
        for q, old, (lead, post, mid) in zip(held.queries(), prefix.queries(), counts, strict=True):
            assert q.target_position == old.target_position - old.shift + extra  # the shift-0 position
            assert post == q.shift and mid == 0 and lead == q.cluster % 2 + extra
