"""The idealized induction model of docs/science.md section 5: its loss, its optimum, its gradient flow.

  config.py   TheoryConfig (the model's sizes and scales) and FlowConfig (its gradient flow's settings)
  model.py    the model and its population loss (closed form, enumeration, Monte Carlo, reference)
  optimum.py  Theorem 1: the oracle optimum is one-hot and adjacent, distinct across heads at eps = 0
  flow.py     Theorem 2: gradient flow of log-linear gates concentrates each head on one position
  run.py      `run_theory`: all checks, the retrieval prediction by position, JSON summary
  cli.py      the `phasekv theory` subcommand (its figures: phasekv.figures.theory)
"""

from phasekv.theory.config import FlowConfig, TheoryConfig
from phasekv.theory.flow import train_gates
from phasekv.theory.model import closed_form_losses, make_embeddings, monte_carlo_loss
from phasekv.theory.optimum import theorem1_check
from phasekv.theory.run import run_theory

__all__ = ["FlowConfig", "TheoryConfig", "closed_form_losses", "make_embeddings", "monte_carlo_loss",
           "run_theory", "theorem1_check", "train_gates"]
