"""Phase-sensitivity evaluation: model adapters, the batched runner, statistics, the shift sweep.

Its figures live in `phasekv.figures.evaluation`.
"""
