"""phasekv.engines."""
