"""Evaluations of reading quality: ``python -m scripts.eval.demo`` (character error rates of a model on held-out
synthetic pages), ``python -m scripts.eval.orientation`` (turning sideways scans upright) and
``python -m scripts.eval.grades`` (the page grades against the truth on a difficulty ladder)."""
