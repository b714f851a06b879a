"""phasekv.conditions."""
