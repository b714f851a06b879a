"""Decision audits: do meaning-preserving shifts change a compressed model's decisions (refuse or comply, yes or
no, which completion)?  Prompt sets as data (`sets.py`), token-exact shifted prompts (`prompts.py`), continuation
scoring through any adapter and condition (`scoring.py`), item-clustered statistics and the verdict (`stats.py`),
the run with resume and atomic outputs (`pipeline.py`) and its report (`report.py`)."""
