"""A tiny random-weight Unlimited-OCR (same transformers classes) for CPU tests.

`build_tiny_model(folder)` writes config, safetensors, tokenizer and processor files so that
`AutoProcessor.from_pretrained(folder)` and `UnlimitedOcrForConditionalGeneration.from_pretrained(folder)`
load it offline. Pages are 256x256 base-mode images: 4x4 vision queries, each row + a newline token,
+ 1 view separator = 21 image tokens per page (the real model: 1024 -> 16x16 -> 273).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
CONTROL_TOKENS = ["<image>", "<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>", "<|grounding|>", "<td>", "</td>", "<PAGE>"]
IMAGE_SIZE = 256  # tokens per page = q * (q + 1) + 1 with q = IMAGE_SIZE // 16 // 4


def _training_text() -> list[str]:
    import argparse
    import json as _json
    import logging
    import textwrap  # built-in text: a few stdlib docstrings

    docs = [m.__doc__ or "" for m in (argparse, _json, logging, textwrap)]
    labels = ["title", "text", "table", "image", "header", "footer", "list", "caption"]
    lines = [line for doc in docs for line in doc.splitlines() if line.strip()]
    for i, label in enumerate(labels):
        lines.append(f"{label} [{i * 97 % 999}, {i * 131 % 999}, {i * 173 % 999}, {i * 211 % 999}]")
    lines += ["| a | b | c |", "| --- | --- | --- |", "document parsing.", "Multi page parsing.",
              "0 1 2 3 4 5 6 7 8 9 10 100 999", "# Chapter 1", "## Section", "- item", "**bold** _it_"]
    return lines


def build_tokenizer(vocab_extra: int = 0):
    """A small byte-level BPE tokenizer carrying the real model's special tokens (bos id 0, eos id 1)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400 + vocab_extra,
        special_tokens=[BOS, EOS, PAD, *CONTROL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=CONTROL_TOKENS, model_max_length=32768,
    )


def tiny_config(tokenizer, sliding_window: int = 8, image_size: int = IMAGE_SIZE, text_init: float = 0.2):
    from transformers import UnlimitedOcrConfig

    sam = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=image_size, patch_size=16,
               window_size=4, global_attn_indexes=[1], mlp_dim=64, output_channels=32,
               downsample_channels=[32, 48], initializer_range=0.02)
    q = image_size // 16 // 4
    enc = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
               image_size=q * 16, patch_size=16)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, moe_intermediate_size=32, max_position_embeddings=4096,
                sliding_window=sliding_window, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                initializer_range=text_init)
    return UnlimitedOcrConfig(vision_config=dict(sam_config=sam, encoder_config=enc), text_config=text,
                              image_token_id=tokenizer.convert_tokens_to_ids("<image>"))


def set_eos_scale(model, scale: float, seed: int = 0) -> None:
    """Set the lm_head row of EOS. 0 (the default of build_tiny_model): the EOS logit is exactly 0, so it is
    practically never the argmax and greedy outputs run to max_new_tokens. A large scale (e.g. 20) gives a
    random row that much longer than the others, so EOS wins within a few steps (tests of an "eos" finish)."""
    eos = model.config.text_config.eos_token_id
    weight = model.lm_head.weight
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(weight.shape[1], generator=gen) * model.config.text_config.initializer_range * scale
    with torch.no_grad():
        weight[eos].copy_(row.to(weight.dtype))


def build_tiny_model(folder: Path, sliding_window: int = 8, seed: int = 0, vocab_extra: int = 0,
                     image_size: int = IMAGE_SIZE, eos_scale: float = 0.0, text_init: float = 0.2) -> Path:
    """Build and save a tiny random UnlimitedOcrForConditionalGeneration with tokenizer and processor.

    sliding_window: R-SWA window n of the decoder (real model: 128). seed: torch seed of the weights.
    vocab_extra: raises the BPE vocabulary target above 400 (it saturates near 1300 on the built-in text).
    image_size: base-mode page size (256 -> 21 image tokens per page). eos_scale: see set_eos_scale.
    text_init: decoder init range; 0.02 makes greedy outputs loop (what the no-repeat-ngram rule is for).
    Decoder: 3 layers (layer 0 dense, 1-2 MoE with 4 experts, top-2, 1 shared), hidden 64, 4 heads; init 0.2
    so that greedy outputs are long and varied (at 0.02 they collapse into 2-12 token loops).
    """
    from transformers import (
        GenerationConfig,
        UnlimitedOcrForConditionalGeneration,
        UnlimitedOcrImageProcessor,
        UnlimitedOcrProcessor,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_extra)
    torch.manual_seed(seed)
    model = UnlimitedOcrForConditionalGeneration(tiny_config(tokenizer, sliding_window, image_size, text_init)).eval()
    set_eos_scale(model, eos_scale)
    # A config not derived from the model config (`_from_model_config` set would drop custom entries on load).
    # n=35 and window 128 mirror the official single-page rule; the window is a custom entry read by the
    # model's generation mixin, so `generate(..., no_repeat_ngram_window_size=W)` works once it is present.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False, no_repeat_ngram_size=35,
        no_repeat_ngram_window_size=128)
    model.save_pretrained(folder)
    image_processor = UnlimitedOcrImageProcessor(
        size={"height": image_size, "width": image_size}, crop_to_patches=False, tile_size=image_size)
    UnlimitedOcrProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    (folder / "tiny_model.json").write_text(json.dumps(
        {"seed": seed, "sliding_window": sliding_window, "image_size": image_size,
         "tokens_per_page": (image_size // 64) * (image_size // 64 + 1) + 1}, indent=1))
    return folder
