"""Training: `phasekv train`'s loop and the run directory it fills, and the distillation of a retrofit selection's
indexer (`phasekv train-indexer`)."""
