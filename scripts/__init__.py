"""Project scripts, run as modules from the repository root (``python -m scripts.bench.engine --help``):

- `scripts.bench`: what the engine and the pipeline cost (engine, pipeline, cpu, fast) and the GPU exactness check;
- `scripts.eval`: how well a model reads (demo) and how well scans are turned upright (orientation);
- `scripts.train`: training the demo model (demo) and a block drafter (drafter);
- `scripts.synth`: held-out pages of the synthetic document generator (ingest/synth) as PNG files (``python -m scripts.synth``).
- `scripts.check_figures`: every figure the docs cite equals its record under docs/results/ (run by CI).
"""
