"""Split a document's pages into chunks that one decode can carry.

Unlimited-OCR's context (32K by default) holds the prefix (vision tokens per page + the prompt) and the
output of every page in the chunk. A chunk is the longest run of consecutive pages whose estimated total
stays under ``context_limit * (1 - margin)`` and under ``max_pages``. A single page that alone exceeds the
budget still gets its own chunk: the worker's context-limit handling takes it from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TOKENS_PER_PAGE_BASE = 273  # 16x16 vision tokens + a newline per row + 1 separator, base mode 1024 px
PROMPT_TOKENS = 8


@dataclass(frozen=True)
class ChunkPlan:
    context_limit: int = 32_768
    margin: float = 0.1
    max_pages: int = 16
    tokens_per_page_prefix: int = TOKENS_PER_PAGE_BASE
    prompt_tokens: int = PROMPT_TOKENS

    @property
    def budget(self) -> int:
        return int(self.context_limit * (1.0 - self.margin))

    def page_cost(self, expected_output_tokens: int) -> int:
        return self.tokens_per_page_prefix + expected_output_tokens


def plan_chunks(expected_output: Sequence[int], plan: ChunkPlan) -> list[tuple[int, int]]:
    """Return 1-based inclusive (first, last) page ranges covering every page exactly once, in order.

    ``expected_output[i]`` is the expected number of output tokens for page i+1."""
    chunks: list[tuple[int, int]] = []
    first, used = 1, plan.prompt_tokens
    for i, out in enumerate(expected_output, start=1):
        cost = plan.page_cost(out)
        pages_in = i - first
        if pages_in > 0 and (used + cost > plan.budget or pages_in >= plan.max_pages):
            chunks.append((first, i - 1))
            first, used = i, plan.prompt_tokens
        used += cost
    if expected_output:
        chunks.append((first, len(expected_output)))
    return chunks
