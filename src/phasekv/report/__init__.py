"""The reproduction job and its HTML report."""
