"""phasekv.conditions.selection."""
