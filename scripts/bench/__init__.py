"""Benchmarks (``python -m scripts.bench.engine``, ``.pipeline``, ``.cpu``, ``.fast``) and the GPU exactness check
(``python -m scripts.bench.gpu_check``); each prints a table and ends with one JSON line."""
