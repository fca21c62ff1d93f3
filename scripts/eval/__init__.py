"""Evaluations of reading quality: ``python -m scripts.eval.demo`` (character error rates of a model on held-out
synthetic pages) and ``python -m scripts.eval.orientation`` (turning sideways scans upright)."""
