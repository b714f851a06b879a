"""Configuration files and `--set` overrides: strict YAML and JSON parsing, `a.b=value` overrides.

The parsers refuse, in one line naming the file, what a config must not hold: duplicate keys, YAML
aliases (no billion-laughs expansion), nesting deeper than MAX_NESTING, values JSON cannot write back
(dates, binary data, sets, non-string keys) and files over MAX_CONFIG_BYTES.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import yaml

MAX_NESTING = 32  # deepest mapping/list accepted in a config file
MAX_CONFIG_BYTES = 1 << 20  # an experiment YAML is a few KB; a larger file is refused before it is read
SECTIONS = ("model", "data", "train", "eval", "notes", "vocab")  # the top-level sections of an experiment


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that refuses duplicate keys and aliases (no billion-laughs expansion)."""

    def compose_node(self, parent, index):  # noqa: ANN001 - yaml's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"aliases (*{event.anchor}) are not allowed{event.start_mark}")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool) and key is not None:  # a list or mapping as a key
                raise yaml.YAMLError(f"a mapping key must be a plain value, got a {type(key).__name__}"
                                     f"{key_node.start_mark}")
            if key in seen:
                raise yaml.YAMLError(f"duplicate key {key!r}{key_node.start_mark}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _depth(tree: Any, limit: int = MAX_NESTING) -> int:
    """Nesting depth of mappings/lists, iteratively (a deep tree must not blow the stack)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, d + 1) for c in children if isinstance(c, dict | list))
    return deepest


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(tree: Any, where: str) -> None:
    """Refuse, in one line, any value JSON cannot write back as it was read: a date or timestamp, !!binary
    bytes, a !!set, a non-string mapping key.  Everything phasekv stores is plain JSON."""
    stack = [(tree, "")]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise ValueError(f"{where}: mapping key {key!r} at {at or 'top level'} is a "
                                     f"{type(key).__name__}; keys must be strings (quote it)")
                stack.append((value, f"{at}.{key}" if at else key))
        elif isinstance(node, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(node))
        elif not isinstance(node, _PLAIN):
            kind = {"date": "a date", "datetime": "a timestamp", "bytes": "binary data", "set": "a set"}.get(
                type(node).__name__, f"a {type(node).__name__}")
            raise ValueError(f"{where}: value at {at or 'top level'} is {kind}, which a config cannot hold; "
                             "quote it to make it a string")


def parse_yaml(text: str, where: str) -> Any:
    try:
        tree = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML ({' '.join(str(exc).split())[:160]})") from None
    except (TypeError, ValueError) as exc:  # e.g. an out-of-range date, a malformed !!binary or timestamp
        raise ValueError(f"{where}: not valid YAML ({' '.join(str(exc).split())[:160]})") from None
    if _depth(tree) > MAX_NESTING:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep")
    _check_plain(tree, where)
    return tree


def parse_json(text: str, where: str) -> Any:
    try:
        tree = json.loads(text)
    except RecursionError:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
    if _depth(tree) > MAX_NESTING:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep")
    return tree


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.lr=3e-3' -> (['train', 'lr'], 0.003); the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"override {text!r}: expected KEY.PATH=VALUE")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ValueError(f"override {text!r}: empty key component")
    parsed = parse_yaml(value, f"override {text!r}")
    if isinstance(parsed, str):  # YAML 1.1 reads 3e-3 (no dot) as a string: take it as the number it is
        with contextlib.suppress(ValueError):
            number = float(parsed)
            parsed = number if math.isfinite(number) else parsed
    return path, parsed


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `tree` with each `a.b=value` override set; unknown sections are errors."""
    tree = json.loads(json.dumps(tree))
    for text in overrides:
        path, value = parse_override(text)
        node = tree
        for part in path[:-1]:
            if part not in node and part in SECTIONS:
                node[part] = {}
            if not isinstance(node.get(part), dict):
                raise ValueError(f"override {text!r}: no section {part!r}")
            node = node[part]
        node[path[-1]] = value
    return tree


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ValueError(f"config {path}: is not a regular file (a directory, pipe or device: process "
                         "substitution such as <(...) is not supported); write the config to a file")
    if not path.is_file():
        raise ValueError(f"config {path}: no such file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"config {path}: {path.stat().st_size} bytes; a config may hold at most "
                         f"{MAX_CONFIG_BYTES} bytes")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"config {path}: unreadable ({exc})") from None
    tree = parse_yaml(text, f"config {path}")
    if not isinstance(tree, dict) or "model" not in tree:
        raise ValueError(f"config {path}: expected a mapping with a 'model' section")
    return tree
