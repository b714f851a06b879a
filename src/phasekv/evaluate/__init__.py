"""Phase-sensitivity evaluation: model adapters, the batched runner, statistics and figures."""
