"""Writing a probe's result: its JSON file and its figure side by side."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phasekv.outputs import write_json

log = logging.getLogger(__name__)


def write_result(out_dir: str | Path, stem: str, result: dict[str, Any],
                 plot: Callable[[dict[str, Any], Path], Path] | None, key: str = "figure") -> dict[str, Any]:
    """Draw `plot(result, out_dir/stem.png)` (None: no figure), record its path under `key`, write
    out_dir/stem.json.  The path is recorded relative to out_dir: commands build out_dir under a temporary
    name and publish it afterwards, so an absolute path would name a directory that no longer exists."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        result[key] = str(Path(plot(result, out / f"{stem}.png")).relative_to(out))
    write_json(out / f"{stem}.json", result, sort_keys=False)
    log.info("wrote %s", out)
    return result
