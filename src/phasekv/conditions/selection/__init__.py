"""Query-dependent pooled selection as an audit condition: the adapter (`pooled.py`), its kernel with a slow
reference (`kernel.py`) and the scorers that rank pools (`scorers.py`)."""
