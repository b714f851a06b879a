"""How phasekv reaches a model it measures: engines it launches and the adapters the evaluation talks to."""
