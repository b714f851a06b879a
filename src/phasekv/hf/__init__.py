"""phasekv and transformers meeting: phasekv checkpoints through transformers' Auto classes, and a causal-LM head
for a transformers text model that has none."""
