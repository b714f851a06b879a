"""Synthetic data: the word vocabulary, the lookup prompt family with its training stream, and the
evaluation prompt sets of the two padding protocols (docs/science.md section 3)."""

from phasekv.config import PROTOCOLS
from phasekv.data.lookup import (
    IGNORE,
    Batch,
    Example,
    MarkovChain,
    TrainingStream,
    assemble,
    outside_local_window,
)
from phasekv.data.protocols import Context, EvalSet, Prompt, Query, build_eval_set
from phasekv.data.vocab import GROUPS, Vocabulary

__all__ = [
    "GROUPS", "IGNORE", "PROTOCOLS", "Batch", "Context", "EvalSet", "Example", "MarkovChain",
    "Prompt", "Query", "TrainingStream", "Vocabulary", "assemble", "build_eval_set", "outside_local_window",
]
