"""Mechanistic probes (docs/science.md section 4): KV-head knockout by phase, gate concentration, gate cycling.

All of them reach the model through named hook points (`hooks`) or parameter patches that are
context managers restoring the model on exit.
"""

from phasekv.probes.concentration import Accumulator, concentration, concentration_reference, profile
from phasekv.probes.cycle import cycled_gates, run_cycling
from phasekv.probes.gates import gate_report, gate_statistics, gate_trajectory
from phasekv.probes.hooks import QueryOnly, capture_final_head_outputs, heads_of_kv, mean_knockout, replace_heads
from phasekv.probes.knockout import calibration_means, calibration_set, check_disjoint, run_knockout

__all__ = [
    "Accumulator", "QueryOnly", "calibration_means", "calibration_set", "capture_final_head_outputs",
    "check_disjoint", "concentration", "concentration_reference", "cycled_gates", "gate_report",
    "gate_statistics", "gate_trajectory", "heads_of_kv", "mean_knockout", "profile", "replace_heads",
    "run_cycling", "run_knockout",
]
