"""Held-out pages of the synthetic document generator (``ingest.synth``, which `uflash calibrate` also uses) written as
PNG files with their text layers: ``python -m scripts.synth --help``."""
