"""What an audit does to an in-process model: one file per condition family, every condition checked and built
through the grammar (`grammar.py`)."""
