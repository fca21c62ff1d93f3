"""A full-size stand-in for Unlimited-OCR: the real architecture and settings, random weights planted so that its
output has the real shape. Made in seconds, never committed; ``uflash`` loads it through ``model.path``.

    python -m scripts.standin /tmp/standin --tokens-per-page 1000            # on the GPU machine (bf16, on cuda)
    python -m scripts.standin /tmp/standin --check --pages 1,2,16            # decode chunks with the engine, check
    python -m scripts.standin /tmp/tiny --tiny --tokens-per-page 24          # a tiny one for CPU tests

What it is: ``UnlimitedOcrConfig()`` (12-layer MoE decoder, 64 experts top-6, vocab 129,280, window 128, the
DeepEncoder vision tower; the SAM tower with a normal init), the real processor settings (1024-pixel base mode,
273 tokens a page), a word-level tokenizer of 129,280 ids with the real special-token ids (`scripts.standin.vocab`),
weights saved with ``save_pretrained``. A chunk of P pages decodes greedily into P pages of ``--tokens-per-page``
distinct tokens each, ``<PAGE>`` between pages, EOS at the end (`scripts.standin.plant` says how), at most
``--max-pages`` pages a chunk.

What it shows: the cost of the real model at the real output shape: every weight full size and read as the real
model reads it, vision, prefill and decode steps at the real lengths, MoE routing spread over the experts (each
token's random embedding picks its experts), page separators and EOS where the pipeline expects them, load time
from safetensors. What it does not show: anything about reading (its text is meaningless words), the acceptance of
any drafter (no page repeats a phrase, so n-gram and markup drafts find nothing; a scan has no text layer to draft
from), the real model's output lengths (every page is exactly N tokens), its quality grades.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from scripts.standin.plant import plant, token_path
from scripts.standin.vocab import SPECIALS, build_tokenizer

PAGE_ID = 128823
TINY_IMAGE = 256  # tiny pages: 4x4 queries, 21 tokens a page


def standin_config(tiny: bool):
    from transformers import UnlimitedOcrConfig

    if not tiny:
        config = UnlimitedOcrConfig()
        config.vision_config.sam_config.initializer_range = 0.02  # its default 1e-10 leaves the SAM tower dead
        return config
    sam = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=TINY_IMAGE, patch_size=16,
               window_size=4, global_attn_indexes=[1], mlp_dim=64, output_channels=32, downsample_channels=[32, 48],
               initializer_range=0.02)
    enc = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
               image_size=TINY_IMAGE // 4, patch_size=16)
    text = dict(hidden_size=384, intermediate_size=768, num_hidden_layers=3, num_attention_heads=3,
                num_key_value_heads=3, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                moe_intermediate_size=64, sliding_window=16)
    return UnlimitedOcrConfig(vision_config=dict(sam_config=sam, encoder_config=enc), text_config=text)


def build_standin(folder: Path, tokens_per_page: int = 1000, max_pages: int = 32, tiny: bool = False,
                  device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Build, plant and save the stand-in in ``folder``; returns its description (also in ``standin.json``)."""
    from transformers import (
        GenerationConfig,
        UnlimitedOcrForConditionalGeneration,
        UnlimitedOcrImageProcessor,
        UnlimitedOcrProcessor,
    )

    t0 = time.perf_counter()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = standin_config(tiny)
    text = config.text_config
    torch.manual_seed(seed)
    with torch.device(device):
        model = UnlimitedOcrForConditionalGeneration._from_config(config, dtype=dtype)
    model = model.to(device).eval().requires_grad_(False)
    built = time.perf_counter()
    image_processor = UnlimitedOcrImageProcessor(
        **({"size": {"height": TINY_IMAGE, "width": TINY_IMAGE}, "tile_size": TINY_IMAGE} if tiny else {}))
    processor = UnlimitedOcrProcessor(image_processor=image_processor, tokenizer=tokenizer)
    q = image_processor.size["height"] // 16 // 4
    image_tokens = q * (q + 1) + 1
    single = tokenizer("<image>document parsing.")["input_ids"]
    multi = tokenizer("<image>Multi page parsing.")["input_ids"]
    if single[-1] != multi[-1]:
        raise RuntimeError("both prompts must end with the same token")
    reserved = {0, 1, 2, 3, *SPECIALS, *single, *multi}
    path = token_path(text.vocab_size, reserved, tokens_per_page, max_pages, seed)
    info = plant(model, path, prompt_end=single[-1], page_sep=PAGE_ID, eos=text.eos_token_id,
                 image_tokens_per_page=image_tokens, prompt_tokens=len(multi), seed=seed)
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=2, do_sample=False, no_repeat_ngram_size=35,
        no_repeat_ngram_window_size=128)
    planted = time.perf_counter()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    desc = {"standin": True, "tiny": tiny, "dtype": str(dtype).removeprefix("torch."), "image_tokens_per_page": image_tokens,
            "params": sum(p.numel() for p in model.parameters()), "first_tokens": [ids[0] for ids in path],
            **info, "build_s": round(built - t0, 2), "plant_s": round(planted - built, 2),
            "save_s": round(time.perf_counter() - planted, 2)}
    (folder / "standin.json").write_text(json.dumps(desc, indent=1))
    return desc


def check_output(ids: list[int], n_pages: int, tokens_per_page: int, eos: int = 1, page_sep: int = PAGE_ID) -> list[str]:
    """What is wrong with a chunk's output ``ids`` against the planted shape (empty: nothing)."""
    problems = []
    if not ids or ids[-1] != eos:
        problems.append(f"does not end with EOS (last ids {ids[-3:]})")
    body = ids[:-1] if ids and ids[-1] == eos else ids
    pages, start = [], 0
    for i, t in enumerate(body + [page_sep]):
        if t == page_sep:
            pages.append(body[start:i])
            start = i + 1
    if len(pages) != n_pages:
        problems.append(f"{len(pages)} pages for {n_pages}")
    if any(len(p) != tokens_per_page for p in pages):
        problems.append(f"page lengths {[len(p) for p in pages]}, not {tokens_per_page}")
    if len(set(body) - {page_sep}) != len(body) - (len(pages) - 1):
        problems.append("a token repeats")
    return problems
