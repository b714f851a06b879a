"""README.md's generated blocks: the fixes table and the k-pool paragraph, drawn from the run summaries kept under
docs/summaries/.

The README quotes results that live in summary files (`make demo`'s trimmed summary, `phasekv audit` summaries of
SmolLM2, `research/` tools' outputs).  A number copied by hand drifts from its file the moment either changes, so
each quoted place is a block between two marker lines,

    <!-- generated: NAME (`make results` from docs/summaries/): edit the summaries, not this block -->
    ...
    <!-- end generated -->

whose body is rendered here by a pure function of the summaries (`BLOCKS`); `make results` rewrites every block
(`update`), and tests/test_readme_doc.py renders them again and compares them with the committed README.  What
lies outside the blocks is kept as written: numbers no summary records (timings, hand counts) stay there, as prose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phasekv.outputs import write_atomic
from phasekv.report.results_doc import table, verdict_head

END = "<!-- end generated -->"
MARKER = re.compile(r"^<!-- generated: (?P<name>[\w-]+) [^\n]*-->\n(?P<body>.*?)^" + re.escape(END) + r"\n",
                    re.M | re.S)

# the summaries each block reads (docs/summaries/NAME.json)
DEMO = "demo"  # make demo's summary, trimmed (`make results`)
EXTRA = "fixes-extra"  # the models outside the demo, evaluated by research/fixes_extra.py
SMOLLM2_GRID = "fixes-smollm2"  # post-hoc select with a moved grid on SmolLM2 (docs/notes/fixes.md)
KPOOL_GRID = "kpool-smollm2-fixes-distilled-96"  # k-pool with a jittered pool grid, and its -grids analysis
ORACLE = "kpool-smollm2-oracle-96"
GLM_1_4, MM3_1_4 = "kpool-smollm2", "kpool-smollm2-mm3-025"
GLM_3_4, MM3_3_4 = "kpool-smollm2-distilled-075-96", "kpool-smollm2-mm3-075-96"

# what each phasekv model of the fixes table is (words only: every number comes from a summary)
FIX_LABELS = {"w8s8-4kv": "none (W8/S8, 4 KV heads)", "w9s8-4kv": "one-token overlap (W9/S8)",
              "w8s8-4kv-headstagger": "KV-head stagger", "w8s8-4kv-headstagger-layer": "KV-head + layer stagger",
              "w9s8-4kv-gaps": "**W9/S8 trained with fillers between records**",
              "w8s8-4kv-gaps": "the fillers alone (W8/S8)", "w8s8-4kv-jitter": "random grid per training step"}
GRID_LABELS = {"": "none", "stagger": "per-KV-head stagger", "jitter": "per-request jitter"}


class Summaries:
    """The summary files of one folder, read once each; a missing or unreadable one is one ValueError line."""

    def __init__(self, folder: Path):
        self.folder, self._read = Path(folder), {}

    def __call__(self, name: str) -> Any:
        if name not in self._read:
            path = self.folder / f"{name}.json"
            try:
                self._read[name] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: cannot read the summary a README block needs ({e})") from e
        return self._read[name]

    def has(self, name: str) -> bool:
        return (self.folder / f"{name}.json").is_file()


def _gap_mean(m: dict[str, Any]) -> str:
    return f"{m['max_gap_pp']:.1f} / {100 * m['mean_accuracy']:.1f}"


def _verdicts(prefix: dict[str, Any], insequence: dict[str, Any]) -> str:
    """'phase sensitive under both', or each protocol's verdict head."""
    a, b = verdict_head(prefix.get("verdict")), verdict_head(insequence.get("verdict"))
    return f"{a} under both" if a == b else f"prefix: {a}; in-sequence: {b}"


def _grid(condition: str) -> str:
    """The grid fix a condition applies: '' (none), 'stagger' or 'jitter'."""
    found = re.search(r"(?:^|[,:])(?:grid=)?(stagger|jitter)\b", condition)
    return found.group(1) if found else ""


def _trained_rows(get: Summaries) -> list[list[str]]:
    """phasekv's own models: the demo's baseline and fixes, then the models outside the demo."""
    demo = get(DEMO)
    fix = demo["fixes"][0]
    base_bytes = fix["baseline_cache_bytes_per_token"]
    models = {fix["baseline"]: {**demo["models"][fix["baseline"]], "cache_bytes_per_token": base_bytes}}
    models.update({f["name"]: {**demo["models"][f["name"]], "cache_bytes_per_token": f["cache_bytes_per_token"]}
                   for f in demo["fixes"]})
    if get.has(EXTRA):
        models.update(get(EXTRA)["models"])
    rows = []
    for name, m in models.items():
        b = m["cache_bytes_per_token"]
        budget = f"{b:.1f} B/token" if name == fix["baseline"] else f"{100 * (b / base_bytes - 1):+.1f}%"
        rows.append([FIX_LABELS.get(name, f"`{name}`"), "phasekv, trained", budget, _gap_mean(m["prefix"]),
                     _gap_mean(m["insequence"]), _verdicts(m["prefix"], m["insequence"])])
    return rows


def _select_rows(get: Summaries) -> list[list[str]]:
    """SmolLM2 under post-hoc select (one token in 8), on its own grid and on moved ones."""
    rows = []
    for name, c in get(SMOLLM2_GRID)["conditions"].items():
        if not c.get("cache_bytes"):
            continue  # the dense capability gate
        share = 100 * c["cache_bytes"]["compressed"] / c["cache_bytes"]["full"]
        rows.append([f"{GRID_LABELS[_grid(name)]} (`{name}`)", "SmolLM2, post hoc", f"{share:.1f}% of full",
                     _gap_mean(c["prefix"]), _gap_mean(c["insequence"]), _verdicts(c["prefix"], c["insequence"])])
    return rows


def _kpool_rows(get: Summaries) -> list[list[str]]:
    """SmolLM2 under k-pool selection (distilled GLM-5.3 indexer at 3/4), its pool grid fixed and jittered."""
    grids = get(f"{KPOOL_GRID}-grids")
    rows = []
    for name, c in get(KPOOL_GRID)["conditions"].items():
        if c.get("attended") is None:
            continue
        verdict = _verdicts(c["prefix"], c["insequence"])
        own = grids.get(name) or {}
        if own.get("prefix_own_grid"):
            p, i = own["prefix_own_grid"], own["insequence_own_grid"]
            verdict += (f"; by the phase on each request's own grid: gap {p['max_gap_pp']:.1f} / "
                        f"{i['max_gap_pp']:.1f} pp (p = {p['flatness_p']:.2g} / {i['flatness_p']:.2g})")
        rows.append([f"{GRID_LABELS[_grid(name)]} (k-pool 4, distilled, 3/4)", "SmolLM2, selection",
                     f"{100 * c['attended']:.1f}% attended", _gap_mean(c["prefix"]), _gap_mean(c["insequence"]),
                     verdict])
    return rows


def fixes_block(get: Summaries) -> list[str]:
    """The README's fixes table: every fix beside its unfixed model, under both padding protocols."""
    settings = get(SMOLLM2_GRID)["settings"]
    return [f"**Fixes at the same cache budget** (docs/notes/fixes.md; gap = best minus worst phase, points / mean "
            f"accuracy, %; SmolLM2 post hoc: W{settings['window']}/S{settings['stride']}):", "",
            *table(["fix", "model", "budget", "prefix gap / mean", "in-sequence gap / mean", "verdict"],
                   _trained_rows(get) + _select_rows(get) + _kpool_rows(get))]


def _condition(summary: dict[str, Any], *keys: str) -> dict[str, Any]:
    """The one condition of `summary` whose name holds every key (e.g. 'pool=4', 'indexer=oracle'; a key matches a
    whole 'k=v' item of the name, or its head before ':', as 'indexer=distilled' in 'indexer=distilled:DIR')."""
    def holds(name: str, key: str) -> bool:
        return any(t == key or t.startswith(key + ":") for t in re.split(r"[:,]", name))
    found = [c for name, c in summary["conditions"].items() if all(holds(name, k) for k in keys)]
    if len(found) != 1:
        raise ValueError(f"{len(found)} conditions match {keys} in a k-pool summary (one expected)")
    return found[0]


def _pair(c: dict[str, Any], digits: int = 1) -> str:
    return f"{100 * c['prefix']['mean_accuracy']:.{digits}f}% / {100 * c['insequence']['mean_accuracy']:.{digits}f}%"


def _bounds(c: dict[str, Any]) -> str:
    """The upper bounds of the selection-free contrast under both protocols."""
    return " / ".join(f"{c[p]['contrast_crossfit_bounds_pp'][1]:.1f}" for p in ("prefix", "insequence"))


def kpool_block(get: Summaries) -> list[str]:
    """The README's k-pool paragraph: the oracle at 1/4, the distilled indexers at 1/4 and 3/4."""
    oracle_run = get(ORACLE)
    dense, oracle = oracle_run["conditions"]["none"], _condition(oracle_run, "pool=4", "indexer=oracle")
    token = _condition(oracle_run, "pool=1", "indexer=oracle")
    below = [100 * (dense[p]["mean_accuracy"] - oracle[p]["mean_accuracy"]) for p in ("prefix", "insequence")]
    gap_bound = max(oracle[p]["gap_ci_pp"][1] for p in ("prefix", "insequence"))
    glm_low, mm3_low = (_condition(get(n), "pool=4", "indexer=distilled") for n in (GLM_1_4, MM3_1_4))
    glm, mm3 = (_condition(get(n), "indexer=distilled") for n in (GLM_3_4, MM3_3_4))
    curve = " / ".join(f"{100 * r['accuracy']:.0f}" for r in glm["prefix"]["per_phase"])
    p = {name: " / ".join(f"{c[q]['flatness_p']:.2g}" for q in ("prefix", "insequence"))
         for name, c in (("glm", glm), ("mm3", mm3))}
    return [f"**k-pool selection on SmolLM2** (docs/notes/selection.md): GLM-5.3's and MiniMax-M3's selection and "
            "their real indexer modules on SmolLM2-135M, not their weights; records, pool 4, prefix / in-sequence "
            f"padding. With the oracle indexer at budget 1/4 ({100 * oracle['attended']:.1f}% attended) retrieval "
            f"stays {below[0]:.1f} and {below[1]:.1f} points below dense ({_pair(oracle)} against {_pair(dense)}; "
            f"{oracle['prefix']['n_prompts'] // len(oracle['prefix']['per_phase'])} prompts per phase), "
            f"{verdict_head(oracle['prefix']['verdict'])} (gap at most {gap_bound:.1f} pp), as with token-level "
            f"selection ({_pair(token)}), max-pooled keys and pools 2, 8, 16. Distilled on prose, both real indexers "
            f"destroy retrieval at 1/4 (GLM-5.3's {_pair(glm_low)}, MiniMax-M3's {_pair(mm3_low)}); at 3/4 "
            f"({glm['prefix']['n_prompts'] // len(glm['prefix']['per_phase'])} per phase, the same prompts) "
            f"GLM-5.3's retrieves {_pair(glm)} with {verdict_head(glm['prefix']['verdict'])} (prefix {curve}%; "
            f"flatness p = {p['glm']}; the selection-free contrast at most {_bounds(glm)} pp), MiniMax-M3's "
            f"{_pair(mm3)} with {verdict_head(mm3['prefix']['verdict'])} (p = {p['mm3']}; up to {_bounds(mm3)} pp "
            "not excluded)."]


BLOCKS: dict[str, Callable[[Summaries], list[str]]] = {"fixes": fixes_block, "kpool": kpool_block}


def render(document: str, summaries: Path) -> str:
    """`document` with the body of every generated block rendered again from the summaries in `summaries`;
    ValueError when it has no block or names one `BLOCKS` does not know."""
    get = Summaries(summaries)

    def body(match: re.Match) -> str:
        name = match.group("name")
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r} (known: {', '.join(BLOCKS)})")
        first = match.group(0).split("\n", 1)[0]
        return "\n".join([first, *BLOCKS[name](get), END]) + "\n"

    rendered, count = MARKER.subn(body, document)
    if not count:
        raise ValueError(f"the document has no generated block (a line '<!-- generated: NAME ... -->' and {END!r})")
    return rendered


def begin(name: str) -> str:
    """The first marker line of block `name`."""
    return f"<!-- generated: {name} (`make results` from docs/summaries/): edit the summaries, not this block -->"


def update(readme: Path, summaries: Path) -> bool:
    """Rewrite `readme`'s generated blocks from `summaries` (atomically); True when it changed."""
    document = readme.read_text()
    rendered = render(document, summaries)
    if rendered != document:
        write_atomic(readme, rendered)
    return rendered != document
