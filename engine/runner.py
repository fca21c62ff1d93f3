"""The decoder forward of Unlimited-OCR over an `RswaKVCache`, built from the model's own modules.

Same computation as ``UnlimitedOcrForConditionalGeneration.forward`` under ``generate()``:
- prompt embeddings = ``embed_tokens(ids)`` with the image features (``get_image_features(...).pooler_output``,
  concatenated over pages) scattered at the ``<image>`` positions (``masked_scatter``, as the HF model does);
- position ids are plain absolute positions, RoPE from the model's ``rotary_emb``;
- every decoder layer is the model's own ``UnlimitedOcrTextDecoderLayer`` (norms, attention projections,
  RoPE, attention interface, dense/MoE MLP); only its cache and mask are ours: the cache object receives
  the layer's keys/values through ``update()`` and the mask is the R-SWA rule of ``RswaKVCache``;
- final norm, ``lm_head``, logits cast to fp32 (as ``generate`` does before the logits processors).

A prefill is one forward over the whole prefix (full causal inside it). A step is one forward over the
tokens that follow the committed length; the caller decides how many of them to ``commit``.
With ``capture_layers`` set, each forward also keeps the outputs of those layers in ``features`` (the block
drafter's input).
"""

from __future__ import annotations

import torch

from engine.rswa_cache import RswaKVCache

RSWA_LAYER = "reference_sliding_attention"


class RswaRunner:
    def __init__(self, model):
        self.model = model
        self.text = model.model.language_model
        config = self.text.config
        if any(kind != RSWA_LAYER for kind in config.layer_types):
            raise ValueError(f"every decoder layer must be {RSWA_LAYER!r}, got {sorted(set(config.layer_types))}")
        self.window = config.sliding_window
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.image_token_id = model.config.image_token_id
        self.capture_layers: tuple[int, ...] = ()  # decoder layers whose outputs each forward keeps (block drafter)
        self.features: torch.Tensor | None = None  # [tokens, len(capture_layers) * hidden] of the last forward

    def new_cache(self, prefix_len: int, max_step_tokens: int) -> RswaKVCache:
        weight = self.text.embed_tokens.weight
        return RswaKVCache(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           prefix_len=prefix_len, window=self.window, max_step_tokens=max_step_tokens,
                           dtype=weight.dtype, device=weight.device)

    @torch.inference_mode()
    def prompt_embeddings(self, inputs) -> torch.Tensor:
        """[1, L, hidden] embeddings of the processor inputs, image features in place."""
        ids = inputs["input_ids"]
        embeds = self.text.embed_tokens(ids)
        if inputs.get("pixel_values") is None:
            return embeds
        features = self.model.model.get_image_features(
            inputs["pixel_values"], inputs.get("pixel_values_local"), inputs.get("num_local_patches"),
            inputs.get("patches_grid"), return_dict=True).pooler_output
        features = torch.cat(features, dim=0).to(embeds.device, embeds.dtype)
        slots = (ids == self.image_token_id)[..., None]
        if slots.sum() * embeds.shape[-1] != features.numel():
            raise ValueError(f"{int(slots.sum())} image tokens for {features.shape[0]} image features")
        return embeds.masked_scatter(slots, features)

    @torch.inference_mode()
    def prefill(self, inputs, max_step_tokens: int) -> tuple[RswaKVCache, torch.Tensor]:
        """A fresh cache holding the prefix, committed, and the fp32 logits [vocab] of its last position."""
        embeds = self.prompt_embeddings(inputs)
        cache = self.new_cache(embeds.shape[1], max_step_tokens)
        hidden = self._layers(cache, embeds)
        cache.commit(embeds.shape[1])
        return cache, self._logits(hidden[0, -1])

    @torch.inference_mode()
    def step(self, cache: RswaKVCache, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(token_ids), vocab] of the tokens at positions ``cache.length ..``; commits nothing."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=cache.tags.device)
        return self._logits(self._layers(cache, self.text.embed_tokens(ids)))[0]

    def _layers(self, cache: RswaKVCache, embeds: torch.Tensor) -> torch.Tensor:
        positions, mask = cache.begin_step(embeds.shape[1])
        position_embeddings = self.text.rotary_emb(embeds, position_ids=positions)
        hidden = embeds
        kept = []
        for i, layer in enumerate(self.text.layers):
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache,
                           position_embeddings=position_embeddings)
            if i in self.capture_layers:
                kept.append(hidden[0])
        self.features = torch.cat(kept, dim=-1) if kept else None
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.text.norm(hidden)).float()
