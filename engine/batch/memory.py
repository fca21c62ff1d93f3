"""How many rows a batch can hold: ``engine.max_batch = "auto"``.

A row costs its key/value cache (every layer: the prefix region plus the output ring, keys and values), its share
of the step's logits buffer (``max_width`` rows of the vocabulary) and the step's activations (hidden states,
MoE routing copies, fp32 logits for the summary). The rows that fit in the free GPU memory, after a reserve for
the vision tower and a prefill, capped at ``MAX_ROWS``. On the CPU: ``CPU_ROWS`` (batching amortises the weights'
reads there too, and more rows only delay each chunk).
"""

from __future__ import annotations

import math

import torch
from loguru import logger

MAX_ROWS = 256
CPU_ROWS = 4
RESERVE_BYTES = 3 * 2**30  # vision tower over a group of pages, a prefill's activations, allocator slack
USABLE = 0.85  # of the free memory once the reserve is taken


def row_bytes(loaded, prefix_len: int, k_max: int) -> int:
    c = loaded.model.config.text_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    item = torch.tensor([], dtype=loaded.dtype).element_size()
    width = k_max + 1
    ring = math.ceil((c.sliding_window + width - 1) / 16) * 16
    cache = c.num_hidden_layers * 2 * (ring + prefix_len) * c.num_key_value_heads * head_dim * item
    logits = width * c.vocab_size * (item + 4 + 4)  # the shared buffer, its fp32 copy and the logsumexp temp
    activations = width * (40 * c.hidden_size + c.num_experts_per_tok * 3 * c.moe_intermediate_size) * 4
    return cache + logits + activations


def auto_batch(loaded, prefix_len: int, k_max: int) -> int:
    """Rows for chunks of up to ``prefix_len`` prefix tokens (see the module docstring)."""
    if loaded.device.type != "cuda":
        return CPU_ROWS
    free, _ = torch.cuda.mem_get_info(loaded.device)
    per_row = row_bytes(loaded, prefix_len, k_max)
    rows = int(max(0, free - RESERVE_BYTES) * USABLE // per_row)
    rows = max(1, min(MAX_ROWS, rows))
    logger.info("max_batch auto: {} rows ({:.0f} MiB each, {:.1f} GiB free)", rows, per_row / 2**20, free / 2**30)
    return rows
