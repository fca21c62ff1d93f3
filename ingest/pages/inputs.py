"""The model's inputs of a chunk, built where its pages are prepared (a page-preparation process, ingest.pages.pool)
rather than on the worker's thread when the chunk is submitted.

``model_inputs`` runs the processor (``engine.official.chunk_inputs``, exactly as the engine would) on the chunk's
pages as they were rendered, and on each turn of a page that looks turned (ingest.pages.orientation: the page as it
is and its candidate turns), which the worker's orientation probes read alone (the single-page prompt).
``turned_inputs`` gives the chunk's inputs once the probes have turned some of its pages: each turned page's pixels
are those of its probe at that turn. That equals the processor run on the turned pages because the processor
prepares each page on its own (tests/test_prepare_pool.py holds it); when the inputs do not have that shape (one
row of pixels per page) the worker's thread runs the processor instead, as it does without preparation processes.
"""

from __future__ import annotations

import copy
from typing import Any

from PIL import Image

from engine.official import chunk_inputs
from ingest.pages.orientation import InkMeasures, turn


def model_inputs(processor: Any, images: list[Image.Image], ink: list[InkMeasures | None]
                 ) -> tuple[Any, dict[tuple[int, int], Any]]:
    """(the chunk's inputs, {(position in the chunk, turn): a probe's inputs}); a processor that fails leaves them
    to the worker (``(None, {})``: its thread runs the processor at submit and meets the error there, as it always
    did)."""
    try:
        inputs = chunk_inputs(processor, images, "single" if len(images) == 1 else "multi")
        probes = {}
        for i, (image, m) in enumerate(zip(images, ink)):
            for t in (0, *m.candidates) if m is not None and m.candidates else ():
                probes[(i, t)] = inputs if len(images) == 1 and t == 0 else \
                    chunk_inputs(processor, [turn(image, t)], "single")
        return inputs, probes
    except Exception:  # noqa: BLE001 - the same call on the worker's thread raises it again, as a chunk's failure
        return None, {}


def turned_inputs(inputs: Any, probe_inputs: dict[tuple[int, int], Any], turns: dict[int, int]) -> Any:
    """``inputs`` with the page at each position of ``turns`` (position -> degrees clockwise) turned; None when a turned
    page's inputs are not at hand or the inputs are not one row of pixels per page (the processor then runs on the
    worker's thread)."""
    turns = {i: t for i, t in turns.items() if t}
    if inputs is None or not turns:
        return inputs
    pixels = inputs.get("pixel_values")
    if pixels is None or "pixel_values_local" in inputs or any((i, t) not in probe_inputs for i, t in turns.items()):
        return None
    pixels = pixels.clone()
    for i, t in turns.items():
        page = probe_inputs[(i, t)]["pixel_values"]
        if page.shape[0] != 1 or page.shape[1:] != pixels.shape[1:] or i >= pixels.shape[0]:
            return None
        pixels[i] = page[0]
    out = copy.copy(inputs)  # the processor's BatchFeature, its own dict
    out["pixel_values"] = pixels
    return out
