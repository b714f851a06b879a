"""phasekv.training."""
