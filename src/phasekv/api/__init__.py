"""phasekv from Python, where researchers already work: `audit` and `evaluate` of a model object (a transformers
causal LM or a phasekv model, as it sits in a notebook or a training loop), a path or an endpoint URL, returning a
result object that writes nothing unless asked (`audit.py`, `result.py`); the phase check inside training loops
(`phase_check.py`); results in the Hugging Face Hub's eval-results format (`publish.py`)."""
