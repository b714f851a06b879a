"""A regression gate for an engine's CI: `phasekv audit ... --expect FILE` (and `--write-expect FILE` from a trusted
run).

An expectations file (JSON, or YAML of the same shape) holds, per grid point (`audit` for an audit of one server)
and protocol:

    verdict / query_verdict          the verdict class of the source phase / the query phase (the verdict without
                                     its numbers: "no phase effect detected", "phase sensitive", ...)
    agreement_at_least               a lower bound of the engine-vs-reference agreement (a fraction)
    CHECK_agreement_at_least         the same for a per-point check (decode, prefix, batch)
    accuracy                         per source phase: [low, high], the interval its accuracy must fall in

`write_expectations` takes the bounds from a trusted run: its verdict classes, the lower ends of the Wilson 95%
intervals of its agreements and the Wilson 95% intervals of its per-phase accuracies (a point whose server did not
come up gets none).  `check_expectations`
returns one line per violated expectation (the command exits with status 3 when there is any: distinct from bad
input, 2); a point or protocol that is expected and absent, or failed, is a violation too.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from phasekv.auditing.engine_grid import CHECKS, verdict_class
from phasekv.config import MAX_CONFIG_BYTES, parse_yaml
from phasekv.evaluate.metrics import wilson_interval

log = logging.getLogger(__name__)

EXPECT_VERSION = 1
AUDIT_POINT = "audit"  # the one "point" of an audit of a server the user runs
_FIELDS = {"verdict", "query_verdict", "agreement_at_least", "accuracy", *(f"{c}_agreement_at_least" for c in CHECKS)}


def observed(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{point: {protocol: {verdict, query_verdict, agreement (k, n), CHECK (k, n), accuracy {phase: (acc, low,
    high)}}} or {point: {"failed": reason}}} of a grid's summary.json or an audit's."""
    if "points" not in summary:  # `phasekv audit`: the uncompressed condition of the served model
        none = summary["conditions"]["none"]
        points = [{"name": AUDIT_POINT, "protocols": {p: none[p] for p in summary["settings"]["protocols"]},
                   "comparison": summary.get("comparison", {})}]
    else:
        points = summary["points"]
    seen: dict[str, dict[str, Any]] = {}
    for p in points:
        if "failed" in p:
            seen[p["name"]] = {"failed": p["failed"]}
            continue
        seen[p["name"]] = {}
        for protocol, m in p["protocols"].items():
            entry: dict[str, Any] = {"verdict": verdict_class(m["verdict"]),
                                     "accuracy": {r["phase"]: (r["accuracy"], r["ci_low"], r["ci_high"])
                                                  for r in m["per_phase"]}}
            if "query_phase" in m:
                entry["query_verdict"] = verdict_class(m["query_phase"]["verdict"])
            if protocol in p.get("comparison", {}):
                o = p["comparison"][protocol]["overall"]
                entry["agreement"] = (o["agree"], o["n"])
            for check in CHECKS:
                result = p.get(check)
                if isinstance(result, dict) and result.get("protocol") == protocol and result["overall"]["n"]:
                    entry[check] = (result["overall"]["agree"], result["overall"]["n"])
            seen[p["name"]][protocol] = entry
    return seen


def write_expectations(summary: dict[str, Any]) -> dict[str, Any]:
    """The expectations a trusted run sets (module docstring)."""
    points: dict[str, Any] = {}
    for name, protocols in observed(summary).items():
        if "failed" in protocols:  # nothing measured to expect (a later run may serve it: then it is not gated)
            log.warning("--write-expect: point %s failed in this run; it gets no expectations", name)
            continue
        points[name] = {}
        for protocol, e in protocols.items():
            out: dict[str, Any] = {"verdict": e["verdict"],
                                   "accuracy": {str(ph): [round(lo, 4), round(hi, 4)]
                                                for ph, (_, lo, hi) in sorted(e["accuracy"].items())}}
            if "query_verdict" in e:
                out["query_verdict"] = e["query_verdict"]
            for key in ("agreement", *CHECKS):
                if key in e:
                    out[f"{key}_at_least" if key == "agreement" else f"{key}_agreement_at_least"] = (
                        math.floor(10_000 * wilson_interval(*e[key])[0]) / 10_000)
            points[name][protocol] = out
    return {"phasekv_expect": EXPECT_VERSION, "points": points}


def load_expectations(path: str | Path) -> dict[str, Any]:
    """An expectations file, checked (one-line ValueError naming the file and the field)."""
    path = Path(path)
    where = f"--expect {path}"
    if not path.is_file():
        raise ValueError(f"{where}: no such file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        tree = parse_yaml(path.read_text(encoding="utf-8"), where)
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not a text file") from None
    if not isinstance(tree, dict) or tree.get("phasekv_expect") != EXPECT_VERSION or not isinstance(
            tree.get("points"), dict):
        raise ValueError(f"{where}: not a phasekv expectations file (phasekv_expect: {EXPECT_VERSION} and points: "
                         "{POINT: {PROTOCOL: ...}}; --write-expect writes one)")
    for point, protocols in tree["points"].items():
        if not isinstance(protocols, dict):
            raise ValueError(f"{where}: points.{point}: must map protocols to expectations")
        for protocol, e in protocols.items():
            here = f"{where}: points.{point}.{protocol}"
            if not isinstance(e, dict) or set(e) - _FIELDS:
                raise ValueError(f"{here}: unknown fields {sorted(set(e) - _FIELDS) if isinstance(e, dict) else e}; "
                                 f"known: {', '.join(sorted(_FIELDS))}")
            for key, bound in e.items():
                if key.endswith("_at_least") and not (isinstance(bound, int | float) and 0 <= bound <= 1):
                    raise ValueError(f"{here}.{key}: must be a fraction in [0, 1], got {bound!r}")
            for phase, interval in e.get("accuracy", {}).items():
                if not (str(phase).isdigit() and isinstance(interval, list) and len(interval) == 2
                        and all(isinstance(x, int | float) for x in interval) and 0 <= interval[0] <= interval[1] <= 1):
                    raise ValueError(f"{here}.accuracy.{phase}: must be PHASE: [low, high] within [0, 1]")
    return tree


def check_expectations(expected: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """One line per violated expectation of `expected` (a loaded file) by the run `summary`."""
    seen, lines = observed(summary), []
    for point, protocols in expected["points"].items():
        if point not in seen:
            lines.append(f"expect: point {point}: not in this run (it has {', '.join(seen) or 'none'})")
            continue
        if "failed" in seen[point]:
            lines.append(f"expect: point {point}: failed: {seen[point]['failed']}")
            continue
        for protocol, e in protocols.items():
            where = f"expect: point {point}, {protocol}"
            got = seen[point].get(protocol)
            if got is None:
                lines.append(f"{where}: not measured in this run")
                continue
            for key, label in (("verdict", "verdict"), ("query_verdict", "query-phase verdict")):
                if key in e and got.get(key) != e[key]:
                    lines.append(f"{where}: {label} is {got.get(key)!r}, expected {e[key]!r}")
            for key, bound in e.items():
                if not key.endswith("_at_least"):
                    continue
                measured = key.removesuffix("_at_least").removesuffix("_agreement")  # agreement, or a check
                if measured not in got:
                    lines.append(f"{where}: {measured} agreement not measured in this run, expected >= {bound:.4f}")
                elif got[measured][0] / got[measured][1] < bound:
                    k, n = got[measured]
                    lines.append(f"{where}: {'' if measured == 'agreement' else measured + ' '}agreement {k}/{n} = "
                                 f"{k / n:.4f}, expected >= {bound:.4f}")
            for phase, (low, high) in e.get("accuracy", {}).items():
                if int(phase) not in got["accuracy"]:
                    lines.append(f"{where}: phase {phase}: not measured in this run")
                    continue
                accuracy = got["accuracy"][int(phase)][0]
                if not low <= accuracy <= high:
                    lines.append(f"{where}: phase {phase}: accuracy {accuracy:.4f} outside [{low:.4f}, {high:.4f}]")
    return lines
