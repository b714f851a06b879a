"""phasekv.audit."""
