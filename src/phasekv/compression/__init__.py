"""Chunked KV compressors behind one interface and a name registry.

Adding a compressor: one file in this package, one `@register("name")`, one import below, one
line in the test matrix (tests/test_compression.py).  See CONTRIBUTING.md.
"""

from phasekv.compression import deepseek, gated  # noqa: F401  (registration side effects)
from phasekv.compression.base import (
    Compressor,
    available,
    build,
    get,
    num_windows,
    register,
    stride_of,
    windows,
)

__all__ = ["Compressor", "available", "build", "get", "num_windows", "register", "stride_of", "windows"]
