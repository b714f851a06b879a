"""The one field validator of every configuration dataclass.

`spec(...)` declares a field with its validation metadata (inclusive bounds, allowed values, > 0);
`check_fields` checks each field's type from its annotation and its range, size or allowed values from
that metadata, before anything is allocated; every error is a `ValueError` naming the field as
`section.field`.  `from_section` builds a dataclass from one section of a file, naming unknown keys.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any


def spec(default: Any = dataclasses.MISSING, *, low: float | None = None, high: float | None = None,
         choices: tuple | None = None, positive: bool = False, factory: Any = None) -> Any:
    """A dataclass field with validation metadata: inclusive bounds, allowed values, > 0."""
    meta = {"low": low, "high": high, "choices": choices, "positive": positive}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
               list: "a list", dict: "a mapping"}


def short(value: Any) -> str:
    """`repr(value)`, cut to 60 characters: a bad value quoted in an error stays one line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(ok, value) for `value` against a type hint; ints become floats for float fields."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is Any:
        return True, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if hint is str:
        return isinstance(value, str), value
    if origin is list:
        if not isinstance(value, list | tuple):
            return False, value
        items = [_coerce(v, args[0]) if args else (True, v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    return isinstance(value, hint), value


def _describe(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args) + (" or null" if len(args) < len(typing.get_args(hint))
                                                        else "")
    if typing.get_origin(hint) is list:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    return _KIND_NAMES.get(typing.get_origin(hint) or hint, str(hint))


def check_fields(obj: Any, section: str) -> None:
    """Check every field of dataclass `obj` for type (from its annotation) and spec metadata."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        name, value = f"{section}.{f.name}", getattr(obj, f.name)
        ok, value = _coerce(value, hints[f.name])
        if not ok:
            raise ValueError(f"{name}: must be {_describe(hints[f.name])}, got {short(value)}")
        object.__setattr__(obj, f.name, value)
        if value is None:
            continue
        meta = f.metadata
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise ValueError(f"{name}: must be one of {list(meta['choices'])}, got {short(value)}")
        if meta.get("positive") and not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value!r}")
        if meta.get("low") is not None and value < meta["low"]:
            raise ValueError(f"{name}: must be >= {meta['low']}, got {value!r}")
        if meta.get("high") is not None and value > meta["high"]:
            raise ValueError(f"{name}: must be <= {meta['high']}, got {value!r}")


def from_section(cls: type, data: Any, section: str) -> Any:
    """`cls(**data)` with unknown keys and non-mapping sections named in the error."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{section}: section must be a mapping, got {short(data)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        raise ValueError(f"{section}.{unknown[0]}: unknown key; known keys: {sorted(names)}")
    return cls(**data)
