"""What a demo-model training step minimises, and its learning-rate schedule.

`loss_fn`: the output tokens' cross-entropy under the R-SWA mask (`demo_model.score`), plus the auxiliary
character-grid and guided-attention losses when their heads are given; `vision_loss`: the auxiliary losses of
the vision tower alone (the vision-only phase); `lr_factor`: linear warm-up, then cosine down to a floor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from scripts.train import demo_model as dm


def loss_fn(model, ids, lengths, pixels, prefix_len, window, grad_vision, pixel_dtype, aux_head=None, grids=None,
            align=None, align_targets=None, n_image_slots: int | None = None) -> dict:
    """Under the R-SWA mask: `loss` (mean cross-entropy of the output tokens, prefix and padding excluded),
    `acc` (token accuracy), `word_acc` (accuracy on tokens that show on the page, when `align_targets` say
    which), `first_acc` (the same on the first such token after markup or a space: word starts), `aux`
    (auxiliary character/position loss, 0 without aux_head / grids), `align` and `align_acc` (guided-attention
    loss and hit rate, 0 without `align`). `grids` / `align_targets` are None when the batch
    has no character cells / no slot targets (`make_batch` decides on the CPU, so no step waits on the GPU);
    n_image_slots (all pages' slots) spares the alignment loss a host sync."""
    T = ids.shape[1]
    for head in (aux_head, align):
        if head is not None:
            head.active = True
    try:
        logits, tokens = dm.score(model, ids, dm.pixels_from_uint8(pixels, pixel_dtype), prefix_len, window,
                                  grad_vision=grad_vision, keep=T - prefix_len + 1, return_tokens=True)
    finally:
        for head in (aux_head, align):
            if head is not None:
                head.active = False
    logits = logits[:, :-1].float()
    targets = ids[:, prefix_len:]
    valid = torch.arange(prefix_len, T, device=ids.device)[None] < lengths[:, None]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    valid_f = valid.reshape(-1).float()
    right = logits.argmax(-1) == targets
    out = {"loss": (loss * valid_f).sum() / valid_f.sum(), "acc": (right & valid).sum() / valid.sum()}
    zero = torch.zeros((), device=ids.device)
    out["word_acc"] = out["first_acc"] = zero
    if align_targets is not None:
        words = align_targets[:, prefix_len - 1 : T - 1] >= 0
        out["word_acc"] = (right & words).sum() / words.sum().clamp(min=1)
        # the first page character after markup or a space: no dictionary can guess it, only reading can
        first = words & ~(align_targets[:, prefix_len - 2 : T - 2] >= 0)
        out["first_acc"] = (right & first).sum() / first.sum().clamp(min=1)
    out["aux"] = zero
    if aux_head is not None and grids is not None:
        out["aux"] = aux_head.loss(tokens, grids)
    elif aux_head is not None:
        aux_head._sam_out = None
    n_keys = None if n_image_slots is None else n_image_slots + 1
    out["align"], out["align_acc"] = align.loss(align_targets, n_keys) if align is not None else (zero, zero)
    return out


def vision_loss(model, pixels, pixel_dtype, aux_head, grids) -> dict:
    """The vision-only phase (`--vision-pretrain-frac`): the auxiliary character/position losses of the vision
    tower alone, no decoder forward. Same keys as `loss_fn`, the language ones zero."""
    aux_head.active = True
    try:
        _, tokens = dm.image_embeddings(model, dm.pixels_from_uint8(pixels, pixel_dtype), True, return_tokens=True)
    finally:
        aux_head.active = False
    zero = torch.zeros((), device=pixels.device)
    if grids is None:  # scan-like pages only: no character cells to learn from
        aux_head._sam_out, aux = None, zero
    else:
        aux = aux_head.loss(tokens, grids)
    return {"loss": zero, "acc": zero, "word_acc": zero, "first_acc": zero, "aux": aux, "align": zero,
            "align_acc": zero}


def lr_factor(step: int, frac: float, warmup: int, floor: float = 0.05) -> float:
    return min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
