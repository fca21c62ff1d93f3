"""Prompt embeddings of chunks: token embeddings with the page images' features in place of the ``<image>`` tokens.

Same computation as ``UnlimitedOcrForConditionalGeneration.forward`` under ``generate()``: ``embed_tokens(ids)``,
then ``get_image_features(...).pooler_output`` (one [tokens, hidden] per page) scattered in page order at the
``<image>`` positions (``masked_scatter``).

`embed_chunks` runs the pages of several chunks through the vision tower together, in groups of at most
``group`` pages. With ``pad_groups`` every group is padded to exactly ``group`` pages (blank pixels), so a page's
features come from the same kernels at the same shapes whichever chunks it was admitted with: with batch-invariant
kernels downstream, a chunk's tokens then do not depend on its neighbours at admission either. ``attention``: how
SAM's attention layers run (`engine.model.sam_attention`: ``model``, the model's own code; ``flex`` or ``sdpa``, fused).
"""

from __future__ import annotations

import torch

from engine.model.sam_attention import fused_sam_attention


def _pages_of(inputs) -> int:
    pixels = inputs.get("pixel_values")
    return 0 if pixels is None else pixels.shape[0]


@torch.inference_mode()
def image_features(model, pixel_values: torch.Tensor, group: int, pad_groups: bool,
                   attention: str = "model") -> list[torch.Tensor]:
    """Per page [tokens, hidden] features of ``pixel_values`` [pages, 3, S, S] (base mode)."""
    with fused_sam_attention(model, attention):
        return _image_features(model, pixel_values, group, pad_groups)


def _image_features(model, pixel_values: torch.Tensor, group: int, pad_groups: bool) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for start in range(0, pixel_values.shape[0], group):
        pixels = pixel_values[start : start + group]
        real = pixels.shape[0]
        if pad_groups and real < group:
            pixels = torch.cat([pixels, pixels.new_zeros((group - real, *pixels.shape[1:]))])
        n = pixels.shape[0]
        features = model.model.get_image_features(pixels, None, [0] * n, [[1, 1]] * n, return_dict=True).pooler_output
        out += list(features)[:real]
    return out


@torch.inference_mode()
def embed_chunks(model, image_token_id: int, inputs_list: list, group: int = 8,
                 pad_groups: bool = False, attention: str = "model") -> list[torch.Tensor]:
    """[1, L_i, hidden] prompt embeddings of each chunk's processor inputs (on the model's device)."""
    text = model.model.language_model
    pixel_list = [inputs["pixel_values"] for inputs in inputs_list if _pages_of(inputs)]
    features = image_features(model, torch.cat(pixel_list), group, pad_groups, attention) if pixel_list else []
    out, used = [], 0
    for inputs in inputs_list:
        ids = inputs["input_ids"]
        embeds = text.embed_tokens(ids)
        n = _pages_of(inputs)
        if n:
            page_features = torch.cat(features[used : used + n], dim=0).to(embeds.device, embeds.dtype)
            used += n
            slots = (ids == image_token_id)[..., None]
            if int(slots.sum()) * embeds.shape[-1] != page_features.numel():
                raise ValueError(f"{int(slots.sum())} image tokens for {page_features.shape[0]} image features")
            embeds = embeds.masked_scatter(slots, page_features)
        out.append(embeds)
    return out
