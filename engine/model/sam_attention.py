"""SAM's attention with its decomposed relative-position bias, fused: the engine's vision calls on CUDA.

Each SAM attention layer of the vision tower adds a bias to its scores: for a query at patch (qh, qw) and a key at
(kh, kw), ``rel_h[q, kh] + rel_w[q, kw]``, two small tables from the query and the layer's ``rel_pos_h``/``rel_pos_w``
(``get_decomposed_rel_pos``). The model's own code builds the whole [pages x heads, patches, patches] bias (3 GiB for
8 pages in bf16 in the 4 global-attention layers) and adds it to materialized scores (eager), or hands it to
scaled-dot-product attention as a float mask (transformers' SDPA class): either way the bias is written and read
once per score, and no flash kernel takes it. Here, ``flex``: PyTorch's FlexAttention with a score modification that
adds the two table entries inside the fused kernel (nothing of [patches, patches] is ever stored); ``sdpa``: the
bias as an additive mask of scaled-dot-product attention (what the model's SDPA class does, whichever class the model
was loaded with). ``model``: the model's own code, untouched (the CPU fp32 default: tests compare it with
``generate()``). ``auto``: ``flex`` on CUDA in bf16 or fp16, ``model`` elsewhere (fp32 is the exactness reference:
there the engine's features are the model's own, as ``generate()``'s are).

``fused_sam_attention(model, kind)`` swaps the forward of the model's SAM attention layers for as long as the
``with`` lasts (layers: ``global``, the global-attention layers only, or ``all``), so the official ``generate()`` path
outside it runs the model's own code. A ``flex`` kernel that cannot be compiled or run on this machine is said once and
replaced by ``sdpa`` from then on (the same sums; only the speed differs).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from loguru import logger

KINDS = ("auto", "model", "sdpa", "flex")
_flex_failed: list[str] = []  # the error the compiled flex kernel met on this machine, once


def resolve(kind: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    """``auto``: ``flex`` on CUDA in a half-precision dtype, ``model`` elsewhere; any other kind as it is."""
    if kind not in KINDS:
        raise ValueError(f"vision attention must be one of {KINDS}, not {kind!r}")
    if kind != "auto":
        return kind
    return "flex" if torch.device(device).type == "cuda" and dtype != torch.float32 else "model"


def sam_attention_layers(model, layers: str = "global") -> list[torch.nn.Module]:
    """The SAM attention modules of ``model`` (an UnlimitedOcrForConditionalGeneration): the global-attention layers'
    (window size 0), or every layer's with ``layers="all"``."""
    encoder = model.model.sam_model if hasattr(model.model, "sam_model") else None
    if encoder is None:
        encoder = next(m for name, m in model.named_modules() if name.endswith("sam_encoder"))
    return [layer.attn for layer in encoder.layers
            if getattr(layer.attn, "use_rel_pos", False) and (layers == "all" or layer.window_size == 0)]


def _rel_tables(attn, query: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rel_h [B*H, N, height], rel_w [B*H, N, width]): the decomposed bias's two tables, as the model computes them."""
    rh = attn.get_rel_pos(height, height, attn.rel_pos_h)
    rw = attn.get_rel_pos(width, width, attn.rel_pos_w)
    q = query.reshape(query.shape[0], height, width, query.shape[-1])
    rel_h = torch.einsum("bhwc,hkc->bhwk", q, rh).reshape(query.shape[0], height * width, height)
    rel_w = torch.einsum("bhwc,wkc->bhwk", q, rw).reshape(query.shape[0], height * width, width)
    return rel_h, rel_w


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(query, key, value, rel_h, rel_w, width: int, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    def biased(score, b, h, q_idx, kv_idx):
        return score + rel_h[b, h, q_idx, kv_idx // width] + rel_w[b, h, q_idx, kv_idx % width]

    run = _compiled_flex() if query.is_cuda else flex_attention  # eager flex: the reference path, for CPU tests
    return run(query, key, value, score_mod=biased, scale=scale)


def fused_forward(attn, hidden_states: torch.Tensor, output_attentions=None, *, kind: str):
    """The attention layer's forward (same inputs and outputs as the model's: [B, height, width, C], weights None) by
    ``kind`` (``flex`` or ``sdpa``)."""
    batch, height, width, _ = hidden_states.shape
    heads, n = attn.num_attention_heads, height * width
    qkv = attn.qkv(hidden_states).reshape(batch, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
    query, key, value = qkv.reshape(3, batch * heads, n, -1).unbind(0)
    rel_h, rel_w = _rel_tables(attn, query, height, width)
    shape = (batch, heads, n, -1)
    q, k, v = query.view(shape), key.view(shape), value.view(shape)
    out = None
    if kind == "flex" and not _flex_failed:
        try:
            out = _flex(q, k, v, rel_h.float().view(batch, heads, n, height),
                        rel_w.float().view(batch, heads, n, width), width, attn.scale)
        except Exception as e:  # noqa: BLE001 - e.g. no compiler for the kernel here: the mask path instead
            _flex_failed.append(f"{type(e).__name__}: {e}")
            logger.warning("SAM attention: the FlexAttention kernel failed ({}); scaled-dot-product attention with the "
                           "bias as a mask from now on", _flex_failed[0].splitlines()[0][:300])
    if out is None:
        bias = (rel_h[:, :, :, None] + rel_w[:, :, None, :]).reshape(batch, heads, n, n)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=attn.scale)
    out = out.view(batch, heads, height, width, -1).permute(0, 2, 3, 1, 4).reshape(batch, height, width, -1)
    return attn.proj(out), None


@contextlib.contextmanager
def fused_sam_attention(model, kind: str, layers: str = "global") -> Iterator[None]:
    """Within the ``with``, the SAM attention layers of ``model`` run ``kind`` (``model``: nothing changes)."""
    if kind == "model":
        yield
        return
    if kind not in ("flex", "sdpa"):
        raise ValueError(f"a fused kind is flex or sdpa, not {kind!r}")
    swapped = sam_attention_layers(model, layers)
    for attn in swapped:
        attn.forward = types.MethodType(functools.partial(fused_forward, kind=kind), attn)
    try:
        yield
    finally:
        for attn in swapped:
            del attn.forward  # the class's own forward again
