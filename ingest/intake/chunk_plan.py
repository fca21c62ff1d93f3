"""Split a document's pages into chunks that one decode can carry.

The model's context (32K by default) holds the prefix (the model's vision tokens per page, for every page, and the
prompt) and the output of every page in the chunk. A chunk is the longest run of consecutive pages whose estimated
total stays under ``context_limit * (1 - margin)`` and under ``max_pages``. A single page that alone exceeds the
budget still gets its own chunk: the worker's context-limit handling takes it from there.

The output of a page is estimated from its PDF text layer when it has one, else ``engine.default_tokens_per_page``.
The vision tokens a page costs are the configured model's own (its processor's base mode, read from the model folder
without loading the weights, by the formula the loaded model uses).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from loguru import logger

PROMPT_TOKENS = 8  # BOS + the prompt text, about
CHARS_PER_TOKEN = 2.0  # rough: markup and boxes add tokens beyond the plain characters
TOKENS_PER_ELEMENT_OVERHEAD = 64
# Unlimited-OCR's base mode (1024 px -> 16x16 vision tokens, a newline per row, a separator): the plan's page cost
# while the configured model folder cannot be read (no model installed yet; the worker waits for one anyway)
UNLIMITED_OCR_TOKENS_PER_PAGE = 273


@dataclass(frozen=True)
class ChunkBudget:
    tokens_per_page: int  # vision tokens of one page in the model's prompt
    context_limit: int = 32_768
    margin: float = 0.1
    max_pages: int = 16
    prompt_tokens: int = PROMPT_TOKENS

    @property
    def budget(self) -> int:
        return int(self.context_limit * (1.0 - self.margin))

    def page_cost(self, expected_output_tokens: int) -> int:
        return self.tokens_per_page + expected_output_tokens


def plan_document_chunks(expected_output: Sequence[int], budget: ChunkBudget) -> list[tuple[int, int]]:
    """1-based inclusive (first, last) page ranges covering every page exactly once, in order.

    ``expected_output[i]`` is the expected number of output tokens for page i+1."""
    chunks: list[tuple[int, int]] = []
    first, used = 1, budget.prompt_tokens
    for i, out in enumerate(expected_output, start=1):
        cost = budget.page_cost(out)
        pages_in = i - first
        if pages_in > 0 and (used + cost > budget.budget or pages_in >= budget.max_pages):
            chunks.append((first, i - 1))
            first, used = i, budget.prompt_tokens
        used += cost
    if expected_output:
        chunks.append((first, len(expected_output)))
    return chunks


def expected_tokens(text_chars: Sequence[int] | None, page_count: int, default_per_page: int) -> list[int]:
    """Output estimate per page: from the text layer's characters when it has text, else ``default_per_page``."""
    if not text_chars:
        return [default_per_page] * page_count
    return [int(c / CHARS_PER_TOKEN) + TOKENS_PER_ELEMENT_OVERHEAD if c > 20 else default_per_page
            for c in text_chars]


_read: dict[str, int | None] = {}  # model folder -> its tokens per page (None: it has no processor config)


def model_tokens_per_page(model_path: str) -> int | None:
    """Vision tokens of one page for the model in ``model_path`` (``engine.model.load.base_tokens_per_page`` on its
    processor_config.json: what ``load_model`` gives as ``tokens_per_page``), or None when the folder has none."""
    if model_path in _read:
        return _read[model_path]
    from engine.model.load import base_tokens_per_page

    try:
        cfg = json.loads((Path(model_path) / "processor_config.json").read_text(encoding="utf-8"))
        processor = SimpleNamespace(image_processor=SimpleNamespace(size=cfg["image_processor"]["size"]),
                                    patch_size=cfg["patch_size"], downsample_ratio=cfg["downsample_ratio"])
        _read[model_path] = base_tokens_per_page(processor)
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.debug("no processor config in {} ({}): chunks planned for Unlimited-OCR's {} tokens a page",
                     model_path, e, UNLIMITED_OCR_TOKENS_PER_PAGE)
        _read[model_path] = None
    return _read[model_path]
