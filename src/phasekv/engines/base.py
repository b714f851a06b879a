"""What every engine file of `phasekv.engines` defines: its API (`Api`: how a token-id prompt is asked and its answer
read) and, for an engine phasekv can start itself, its `Launcher` (the command, the settings a grid varies and their
flags, its health route, what the running server reports about its own settings); plus the grid of settings.

An engine is one file in this folder that sets module-level `API` (an `Api`, where the engine speaks a protocol of
its own) and/or `LAUNCHER` (a `Launcher`); `phasekv.engines.registry` finds them by name.  A setting's values are
checked before any server starts (`Setting.check`: the allowed values or an integer range), so a typo in a grid is
one line, not a server that dies at its fifth point (a key of another engine says which key this one has instead:
`Launcher.hints`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasekv.engines.wire import Answer, Connection, ServerInfo

# the most points an engine grid may have: each point starts a server (minutes), so more is a typo, not a plan
MAX_GRID_POINTS = 256


class Api:
    """One engine API: the request body of a token-id prompt, the parse of its answer, the served model, and the
    server's own account of its prompt cache."""

    name: str
    path: str
    cache_switch = True  # the request can turn the engine's prompt cache on and off (--reuse-prefix)

    def body(self, ids: list[int], top_k: int, model: str, cache_prompt: bool) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, payload: Any) -> tuple[Answer, int | None]:
        """(the answer, the number of prompt tokens the engine read, None where it does not say)."""
        raise NotImplementedError

    def identify(self, conn: Connection, model: str | None) -> ServerInfo:
        raise NotImplementedError

    def generate_body(self, ids: list[int], steps: int, top_k: int, model: str) -> dict[str, Any]:
        """A request for `steps` greedy tokens after `ids` (end of sequence ignored), no prompt cache."""
        raise NotImplementedError

    def parse_steps(self, payload: Any) -> list[Answer]:
        """The answer of `generate_body`: one Answer per generated token, in order."""
        raise NotImplementedError

    # how `continuation_logprobs` reads a continuation's log-probability (one line in `phasekv decide`'s output);
    # empty: the API cannot, and `phasekv decide` refuses it
    scoring = ""

    def continuation_logprobs(self, conn: Connection, prompt: list[int], continuation: list[int], model: str,
                              cache_prompt: bool) -> tuple[list[float], int | None]:
        """(log P(continuation[j] | prompt + continuation[:j]) for each j, as the engine computes it with the raw
        logits of its model; the prompt tokens the engine reused from its cache, None where it does not say).
        Raises EndpointError for an answer that is not what was asked."""
        raise NotImplementedError

    def server_cache(self, conn: Connection) -> tuple[dict[str, Any] | None, bool]:
        """(the server's own account of its prompt cache, None where it gives none; whether it caches prefixes
        whatever a request asks), read once before any prompt is sent."""
        return None, False

    def report(self, conn: Connection) -> dict[str, Any] | None:
        """What a running server the user started says about its settings (recorded beside the verdict), or None
        for an API whose servers report nothing."""
        return None


@dataclass(frozen=True)
class Setting:
    """One engine setting of a grid: its flags (each gets the value) and what it may be (`choices`, or an integer of
    at least `low`); or a bare switch: `switch` maps each value to the flags it adds, without a value after them."""

    flags: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    low: int | None = None
    switch: dict[str, tuple[str, ...]] | None = None

    def check(self, key: str, value: str) -> str:
        allowed = self.choices or tuple(self.switch or ())
        if allowed and value not in allowed:
            raise ValueError(f"--engine-grid {key}={value}: must be one of {', '.join(allowed)}")
        if self.low is not None and not (value.isascii() and value.isdigit() and len(value) <= 9
                                         and int(value) >= self.low):
            raise ValueError(f"--engine-grid {key}={value}: must be an integer >= {self.low} (at most 9 digits)")
        return value

    def args(self, value: str) -> list[str]:
        """The command-line words of this setting at `value`."""
        if self.switch is not None:
            return list(self.switch[value])
        return [part for flag in self.flags for part in (flag, value)]


def _no_prefix_cache(settings: dict[str, str]) -> bool:
    return False


def _no_limits(settings: dict[str, str], *, context: int, slots: int) -> None:
    return None


@dataclass(frozen=True)
class Launcher:
    """How to start one engine: `command(binary, model, port, settings, context, slots)` is its command line,
    `settings` the grid keys it knows, `health` the route that answers 200 once the model is loaded, `api` the
    `--api` phasekv talks to it with, `report` what the running server says about its settings, `startup_s` how
    long it may take to load, `serves` whether the model is a file or a folder, `caches_prefix` whether a point's
    server keeps a prefix cache that requests cannot switch off (its audit then reuses prefixes on purpose),
    `limits` the refusals that need several settings at once, `hints` a word for keys of other engines."""

    name: str
    binary: str  # the default binary, inside the install directory (`--engine-bin` overrides)
    api: str
    settings: dict[str, Setting]
    build: Callable[..., list[str]]
    report: Callable[[Connection], dict[str, Any]]
    health: str = "/health"
    defaults: dict[str, str] = field(default_factory=dict)  # settings given when the grid does not vary them
    home: tuple[str, str] = ("PHASEKV_ENGINE", "llama.cpp")  # (environment variable, default under ~/.cache/phasekv)
    install: str = "make engine builds llama-server"
    startup_s: float = 180.0
    serves: str = "file"
    caches_prefix: Callable[[dict[str, str]], bool] = _no_prefix_cache
    limits: Callable[..., None] = _no_limits
    hints: dict[str, str] = field(default_factory=dict)

    def command(self, binary: Path, model: Path, port: int, settings: dict[str, str], *, context: int,
                slots: int) -> list[str]:
        chosen = {**self.defaults, **settings}
        flags = [part for key, value in chosen.items() for part in self.settings[key].args(value)]
        return self.build(binary, model, port, context=context, slots=slots, flags=flags)

    def root(self) -> Path:
        """The engine's install directory (its environment variable, else under ~/.cache/phasekv)."""
        variable, default = self.home
        return Path(os.environ.get(variable, Path.home() / ".cache" / "phasekv" / default))


def parse_grid(engine: Launcher, items: Sequence[str]) -> list[dict[str, str]]:
    """`key=v1,v2 key2=w1` -> every combination, in the order given (the last key varies fastest); each value
    checked against the engine's settings.  No items: one point with the engine's defaults."""
    axes: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--engine-grid {item!r}: must be KEY=V1,V2,... (keys: {', '.join(engine.settings)})")
        if key not in engine.settings:
            hint = f" ({engine.hints[key]})" if key in engine.hints else ""
            raise ValueError(f"--engine-grid {key}: not a {engine.name} setting{hint}; known: "
                             f"{', '.join(engine.settings)}")
        if key in axes:
            raise ValueError(f"--engine-grid {key}: given twice")
        parts = values.split(",")
        if len(set(parts)) != len(parts):
            raise ValueError(f"--engine-grid {item}: a value is repeated")
        axes[key] = [engine.settings[key].check(key, v) for v in parts]
    size = 1
    for values in axes.values():
        size *= len(values)
    if size > MAX_GRID_POINTS:
        raise ValueError(f"--engine-grid: {size} points (each starts a server); at most {MAX_GRID_POINTS}")
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def point_name(settings: dict[str, str]) -> str:
    """A grid point's directory name: `ubatch=16,flash_attn=on` (`default` for no settings)."""
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "default"
