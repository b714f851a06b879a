"""The compression conditions an audit evaluates a model under: their grammar and checks, in one place.

A condition is a string (`phasekv audit --compress COND`, `--press NAME` becomes `press:NAME`):

    none                                    the full cache (the capability gate)
    select:r, mean, max-norm[+keep-first:n] post-hoc chunk compression of the prefilled cache (`posthoc.py`)
    press:NAME[:k=v,...]                    a kvpress press applied during prefill (`presses.py`)
    kpool:pool=P,top=K|budget=F,...         query-dependent pooled selection (`selection/`)
    slices:kind=contiguous|interleaved,...  head-partitioned history (`head_slices.py`)
    stagger:select:r, jitter:select:r       post-hoc select with the grid moved per KV head / request
                                            (`grid_fixes.py`)

`GRAMMAR` maps a condition's name (the text before its first ':' or '+') to a `Condition`: a check, which refuses
in one line (ValueError) a condition that cannot be evaluated, before any model is loaded, and a factory, which
wraps the audited adapter in the adapter that evaluates it under the condition.  Both get the condition's whole
text and the compression `Geometry` (W, S and the raw local window).

Adding a condition: write its adapter in its own file of `phasekv/conditions/` (a `base.Wrapped` subclass, like
`PosthocAdapter`), then add ONE entry here, `GRAMMAR["name"] = Condition(check, build, syntax=...)`: the audit's
--compress help is generated from the entries' `syntax` (`compress_help`).
What the audit records beside a condition's metrics comes from the adapter too: an `extras(sets, progress)`
method returning a dict (as `SelectionAdapter`'s selection mechanism).
`check_conditions`, `condition_adapter`, the audit (`phasekv.auditing.pipeline`) and the endpoint rule
(`check_served`: a served model is audited as it serves, under `none` only) all read the grammar; nothing in
`evaluate/`, `report/` or `cli/` changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from phasekv.adapters.base import Adapter


@dataclass(frozen=True)
class Geometry:
    """The compression geometry the conditions share: windows of `window` tokens every `stride`, the last
    `local_window` tokens kept raw."""

    window: int = 8
    stride: int = 8
    local_window: int = 16


@dataclass(frozen=True)
class Condition:
    check: Callable[[str, Geometry], None]  # one-line ValueError for a condition that cannot be evaluated
    build: Callable[[Adapter, str, Geometry], Adapter]  # the adapter evaluating the audited one under it
    served: bool = False  # True: a served model (an endpoint) can be evaluated under it
    syntax: str = ""  # its forms and what it is, for the --compress help (one entry per family)


def _check_policy(text: str, geometry: Geometry) -> None:
    from phasekv.conditions.posthoc import parse_policy

    parse_policy(text, geometry.window)


def _posthoc(base: Adapter, text: str, geometry: Geometry) -> Adapter:
    from phasekv.conditions.posthoc import PosthocAdapter

    return PosthocAdapter(base, text, window=geometry.window, stride=geometry.stride,
                          local_window=geometry.local_window)


def _check_press(text: str, geometry: Geometry) -> None:
    from phasekv.conditions.presses import check_press

    check_press(text[len("press:"):])


def _press(base: Adapter, text: str, geometry: Geometry) -> Adapter:
    from phasekv.conditions.presses import PressAdapter

    return PressAdapter(base, text[len("press:"):], stride=geometry.stride)


def _check_none(text: str, geometry: Geometry) -> None:
    if text != "none":  # e.g. "none:1": refused as the policies refuse an unknown name
        _check_policy(text, geometry)


def _fix(text: str, geometry: Geometry):
    from phasekv.conditions.grid_fixes import parse_fix

    return parse_fix(text, geometry.window, geometry.stride, geometry.local_window)


def _fixed(base: Adapter, text: str, geometry: Geometry) -> Adapter:
    from phasekv.conditions.grid_fixes import GridFixAdapter

    return GridFixAdapter(base, _fix(text, geometry))


def _parse_slices(text: str):
    from phasekv.conditions.head_slices import parse_slices

    return parse_slices(text)


def _sliced(base: Adapter, text: str, geometry: Geometry) -> Adapter:
    from phasekv.conditions.head_slices import HeadSliceAdapter

    return HeadSliceAdapter(base, _parse_slices(text))


_MOVED = Condition(_fix, _fixed, syntax="stagger:select:r, jitter:select:r (post-hoc grid per KV head / per request)")
_POSTHOC = Condition(_check_policy, _posthoc, syntax="select:r, mean, max-norm, each optionally +keep-first:n (the "
                                                     "attention sink)")
GRAMMAR: dict[str, Condition] = {
    "none": Condition(_check_none, lambda base, text, geometry: base, served=True,
                      syntax="none (the full cache; the only condition of a served model)"),
    "select": _POSTHOC,
    "mean": _POSTHOC,
    "max-norm": _POSTHOC,
    "press": Condition(_check_press, _press, syntax="press:NAME[:k=v,...] (a kvpress press; also --press NAME)"),
    "kpool": Condition(lambda text, geometry: _parse_selection(text),
                       lambda base, text, geometry: _selection(base, text),
                       syntax="kpool:pool=P,top=K|budget=F[,local=L,sink=N,heads=shared|kv,indexer=oracle|mean|max|"
                              "distilled:DIR,grid=fixed|stagger|jitter,seed=S] (query-dependent pooled selection)"),
    "slices": Condition(lambda text, geometry: _parse_slices(text), _sliced,
                        syntax="slices:kind=contiguous|interleaved[,size=L,shift=fixed|layer|random,group=kv|query,"
                               "local=N,sink=N] (head-partitioned history)"),
    "stagger": _MOVED,
    "jitter": _MOVED,
}


def compress_help(default: tuple[str, ...]) -> str:
    """The --compress help, from the grammar: every condition family's forms once, then the default."""
    families = list({id(c): c for c in GRAMMAR.values()}.values())
    return "conditions: " + "; ".join(c.syntax for c in families) + "; default: " + " ".join(default)


def _parse_selection(text: str):
    from phasekv.conditions.selection.pooled import parse_selection

    return parse_selection(text)


def _selection(base: Adapter, text: str) -> Adapter:
    from phasekv.conditions.selection.pooled import SelectionAdapter

    return SelectionAdapter(base, _parse_selection(text))


def _entry(text: str) -> Condition:
    """The grammar entry of a condition; the posthoc parser names the allowed forms for an unknown name."""
    name = text.strip().split(":", 1)[0].split("+", 1)[0]
    return GRAMMAR.get(name, _POSTHOC)


def check_conditions(conditions: tuple[str, ...], geometry: Geometry) -> None:
    """One-line ValueError for any condition that cannot be evaluated, before a model is loaded."""
    from phasekv.conditions.posthoc import check_geometry

    check_geometry(geometry.window, geometry.stride, geometry.local_window)
    for condition in conditions:
        _entry(condition).check(condition, geometry)


def check_served(conditions: tuple[str, ...]) -> None:
    """An endpoint is audited as it serves: the post-hoc compressions need the cache of an in-process model."""
    other = [c for c in conditions if not _entry(c).served]
    if other:
        raise ValueError(f"--compress {' '.join(other)}: not available with --endpoint (the engine's own "
                            "compression is what is audited; phasekv cannot reach its cache): use --compress none")


def condition_adapter(base: Adapter, condition: str, geometry: Geometry) -> Adapter:
    """The adapter that evaluates `base` under one condition; refused in one line when the model has layers but no
    full-attention one (every condition acts on those only, `conditions.hybrid`: it would change nothing)."""
    if condition != "none" and getattr(base, "module", None) is not None:
        from phasekv.conditions.hybrid import TARGET, layer_kinds

        kinds = layer_kinds(base.module)
        if kinds and TARGET not in kinds:
            raise ValueError(f"--compress {condition}: {type(base.module).__name__} has no full-attention layer "
                             f"(layers: {', '.join(sorted(set(kinds)))}): every layer bounds its own past, so the "
                             "condition would change nothing")
    return _entry(condition).build(base, condition, geometry)
