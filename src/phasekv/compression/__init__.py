"""Chunked KV compressors behind one interface and a name registry.

Adding a compressor: one file in this package (its options dataclass and its class), one
`@register("name", Options)`, one import below, one line in the test matrix
(tests/helpers.py COMPRESSOR_MATRIX).  See CONTRIBUTING.md.
"""

from phasekv.compression import csa2, deepseek, gated, head_slices  # noqa: F401  (registration side effects)
from phasekv.compression.base import (
    Compressor,
    Selection,
    available,
    build,
    compressor_parameters,
    compressors_of,
    get,
    num_windows,
    register,
    shifted_windows,
    windows,
)

__all__ = ["Compressor", "Selection", "available", "build", "compressor_parameters", "compressors_of", "get",
           "num_windows", "register", "shifted_windows", "windows"]
