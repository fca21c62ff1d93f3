"""What a caller hands the batched engine (`ChunkRequest`, made by `BatchEngine.prepare`) and what it gets back
(`ChunkResult`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChunkRequest:
    key: Any  # the caller's handle
    inputs: Any  # processor outputs on the CPU (`engine.official.chunk_inputs`)
    kind: str  # single | multi
    n_pages: int
    max_new_tokens: int
    reference_texts: list[str] | None = None
    replay_ids: list[int] | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    embeds: Any = None  # its prompt embeddings, when made ahead of its admission (`engine.batch.vision_ahead`)
    embeds_ready: Any = None  # the CUDA event they are ready at (None: ready)

    @property
    def prompt_ids(self) -> list[int]:
        return self.inputs["input_ids"][0].tolist()


@dataclass
class ChunkResult:
    request: ChunkRequest
    output_ids: list[int]
    logprobs: list[float]  # per output id: log-softmax of the logits before the bans
    finish_reason: str  # eos | length | repetition (a loop stopped: `engine.batch.loop_watch`)
    seconds: float  # admission to end (the vision and prefill of its admission included)
    stats: dict[str, Any]
