"""phasekv.hf."""
