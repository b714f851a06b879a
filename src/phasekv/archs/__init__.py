"""One home per supported transformers architecture, behind one small interface and a registry.

Everything phasekv knows about an architecture beyond "a causal LM" (its chunked-compression geometry, its
knockout hook target, its compressor gates and what gate cycling rolls, its sparse-attention indexer's training
objective, how its cache is repeated for shared prefill) lives in its own file here; the generic modules
(`phasekv.families`, `phasekv.archs.indexer_kl`, `phasekv.adapters`, `phasekv.probes`, `phasekv.report`) ask
`architecture_of(model)`.  The interface: `phasekv.archs.base`.

Adding an architecture: one file in this package (an `Architecture` subclass decorated with `@register`), one
import below, one line in the test matrix (tests/test_archs.py ARCH_MATRIX).  See CONTRIBUTING.md.
"""

from phasekv.archs import deepseek_v4, deepseek_v32, dense, glm5_next, llama4, minimax_m3  # noqa: F401  (registration side effects)
from phasekv.archs.base import (
    Architecture,
    CompressionGeometry,
    CycledLayer,
    GateLayer,
    Geometry,
    IndexerKind,
    architecture_of,
    available,
    geometry_of,
    get,
    register,
    repeat_rows,
)

__all__ = ["Architecture", "CompressionGeometry", "CycledLayer", "GateLayer", "Geometry", "IndexerKind",
           "architecture_of", "available", "geometry_of", "get", "register", "repeat_rows"]
