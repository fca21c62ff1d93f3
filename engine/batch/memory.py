"""How many rows a batch can hold: ``engine.max_batch = "auto"``.

A row costs its key/value cache (every layer: the prefix region plus the output ring, keys and values), its share
of the step's logits buffer (``max_width`` rows of the vocabulary) and the step's activations (hidden states,
MoE routing copies, fp32 logits for the summary). Admission runs in bounded groups (`engine.batch.admission`: at
most ``ADMIT_PAGES`` pages and ``PREFILL_TOKENS`` prefix tokens a forward), so what it needs on top of the rows is
bounded too: a reserve for one group's pixels, the vision tower over one call's pages (`vision_bytes`: SAM's
global attention holds a score matrix per head and page) and one prefill's activations (`admission_bytes`).
The rows that fit in the free GPU memory after that reserve, with ``USABLE`` of it (allocator slack), capped at
``MAX_ROWS``. On the CPU: ``CPU_ROWS`` (batching amortises the weights' reads there too, and more rows only delay
each chunk).

Sized for the longest chunk (``prefix_len``: e.g. 16 pages, bucketed as the cache holds it) and for the mode's own
steps (plain decoding's are one token wide: a smaller share of the logits and activations), the batch fits whatever
chunks come; should the estimate still be short, out of memory shrinks the admission group or the batch and loses
nothing (`engine.batch.admission`, `BatchEngine._shrink`): admission then drops the rows whose memory it lacks, by
what it measured it needed (its largest group, or the allocation that failed on top of what it held then), and no
more once the free memory covers that.
"""

from __future__ import annotations

import math

import torch
from loguru import logger

from engine.batch.admission import ADMIT_PAGES, PREFILL_TOKENS, VISION_GROUP

MAX_ROWS = 256
STEP_TOKENS_PER_ROW = 8  # a drafting mode's steps at full rows: 8 tokens a row (wider steps when fewer rows decode)
CPU_ROWS = 4
VISION_BASE = 2 * 2**30  # the vision tower's other working memory (windowed SAM layers, CLIP), allocator slack
USABLE = 0.85  # of the free memory once the reserve is taken


def row_bytes(loaded, prefix_len: int, k_max: int, step_width: int | None = None) -> int:
    """What one row costs: its key/value cache at ``prefix_len`` prefix slots (bucketed as the cache holds them) and
    an output ring for ``k_max`` drafts (every mode: the ring is the same, `engine.batch.engine`), and its share of
    the logits buffer and of the step's activations at the tokens a row's step takes at full rows (``step_width``: 1
    for plain decoding; ``STEP_TOKENS_PER_ROW`` for a drafting mode sized by ``auto_batch``, whose steps then run
    within that many tokens a row: ``BatchEngine(step_tokens=...)``; ``k_max + 1`` by default)."""
    from engine.model.kv_slots import PREFIX_BUCKETS, bucket

    c = loaded.model.config.text_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    item = torch.tensor([], dtype=loaded.dtype).element_size()
    width = k_max + 1 if step_width is None else step_width
    ring = math.ceil((c.sliding_window + k_max) / 16) * 16
    prefix = bucket(prefix_len, PREFIX_BUCKETS)
    cache = c.num_hidden_layers * 2 * (ring + prefix) * c.num_key_value_heads * head_dim * item
    logits = width * c.vocab_size * (item + 4)  # the shared buffer, and an fp32 row sum where the kernels need one
    activations = width * (40 * c.hidden_size + c.num_experts_per_tok * 3 * c.moe_intermediate_size) * 4
    return cache + logits + activations


def vision_bytes(loaded, vision_group: int = VISION_GROUP) -> int:
    """The vision tower over ``vision_group`` pages at its peak: each of SAM's global-attention layers holds a score
    matrix of (patches per page)^2 per head and page, and its softmax a second one (at 1024 pixels, 16-pixel patches,
    12 heads, bf16: 384 MiB each a page, so 3 GiB each for 8 pages), beside ``VISION_BASE``."""
    sam = getattr(getattr(loaded.model.config, "vision_config", None), "sam_config", None)
    if sam is None:
        return VISION_BASE
    item = torch.tensor([], dtype=loaded.dtype).element_size()
    patches = (sam.image_size // sam.patch_size) ** 2
    return VISION_BASE + 2 * vision_group * sam.num_attention_heads * patches * patches * item


def admission_bytes(loaded, image_size: int = 1024, vision_group: int = VISION_GROUP) -> int:
    """What one admission group holds on the device at its peak: its pixels (fp32 as the processor made them, then
    in the model's dtype), the vision tower's working memory, one prefill of ``PREFILL_TOKENS`` tokens (hidden
    states, attention projections, the MoE's routed copies, each a few times over) and the group's embeddings."""
    c = loaded.model.config.text_config
    item = torch.tensor([], dtype=loaded.dtype).element_size()
    pixels = ADMIT_PAGES * 3 * image_size * image_size * (4 + item)
    per_token = (16 * c.hidden_size + 4 * c.num_experts_per_tok * c.moe_intermediate_size
                 + 3 * c.intermediate_size) * max(item, 4)
    return pixels + vision_bytes(loaded, vision_group) + PREFILL_TOKENS * per_token


def free_bytes(device) -> int:
    """Memory a large allocation can take on a CUDA ``device``: the driver's free memory once torch's allocator gave
    back the segments it holds unused. What it keeps unused in segments still partly in use is left out: those pieces
    cannot serve a request larger than themselves (an admission asks for GiB at once), and counting them made an
    admission that ran out of memory look covered."""
    torch.cuda.empty_cache()
    driver_free, _ = torch.cuda.mem_get_info(device)
    return driver_free


def auto_batch(loaded, prefix_len: int, k_max: int, drafting: bool = True) -> int:
    """Rows for chunks of up to ``prefix_len`` prefix tokens (see the module docstring); ``drafting``: a mode whose
    steps take ``STEP_TOKENS_PER_ROW`` tokens a row at full rows (give the engine ``step_tokens`` = rows x that); else
    plain decoding, whose steps are one token wide."""
    if loaded.device.type != "cuda":
        return CPU_ROWS
    free = free_bytes(loaded.device)
    per_row = row_bytes(loaded, prefix_len, k_max, STEP_TOKENS_PER_ROW if drafting else 1)
    reserve = admission_bytes(loaded)
    rows = int(max(0, free - reserve) * USABLE // per_row)
    rows = max(1, min(MAX_ROWS, rows))
    logger.info("max_batch auto: {} rows of {} prefix tokens ({:.0f} MiB each, {:.1f} GiB kept for admission, "
                "{:.1f} GiB free)", rows, prefix_len, per_row / 2**20, reserve / 2**30, free / 2**30)
    return rows


def rows_to_drop(per_row: int, need: int, free: int) -> int:
    """Rows whose memory admission lacks: ``need`` - ``free`` bytes at ``per_row`` bytes a row, at least one."""
    return max(1, math.ceil((need - free) / max(1, per_row)))
