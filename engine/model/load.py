"""Load Unlimited-OCR (real weights or the tiny test model) for real use.

`load_model(path)` accepts a local folder or a hub id that is already in the local Hugging Face cache
(it never downloads: the workstation runs unattended). Errors are one-line and actionable:
`ModelNotFound` (engine.model.files) when there is nothing to load, `ModelLoadError` when what is there is broken.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from engine.kernels.static_moe import make_official_experts_runnable
from engine.model.files import resolve_path

PAGE_SEPARATOR = "<PAGE>"
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


class ModelLoadError(Exception):
    """Files are there but cannot be loaded (bad config.json, truncated weights, wrong architecture)."""


@dataclass
class LoadedModel:
    model: Any  # UnlimitedOcrForConditionalGeneration, eval mode, no grad
    processor: Any  # UnlimitedOcrProcessor
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    name: str  # folder name or hub id
    path: str  # resolved local folder
    image_token_id: int
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None
    page_sep_id: int | None  # id of "<PAGE>" when it is a single token, else None
    sliding_window: int
    tokens_per_page: int  # image tokens of one page in base mode (273 for the real model)


def pick_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """auto: cuda when available; bf16 on GPUs that support it, fp16 on older ones, fp32 on CPU."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dtype != "auto":
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, bf16, fp16 or fp32")
        return dev, _DTYPES[dtype.lower()]
    if dev.type == "cuda":
        return dev, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return dev, torch.float32


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"


def base_tokens_per_page(processor) -> int:
    """q * (q + 1) + 1 with q = size // patch_size / downsample_ratio (processor's own formula)."""
    size = max(processor.image_processor.size["height"], processor.image_processor.size["width"])
    q = math.ceil(size // processor.patch_size / processor.downsample_ratio)
    return q * (q + 1) + 1


def load_model(path: str, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    from transformers import AutoConfig, AutoProcessor, UnlimitedOcrForConditionalGeneration

    folder = resolve_path(str(path))
    dev, dt = pick_device_dtype(device, dtype)
    start = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {_one_line(exc)}") from exc
    if getattr(config, "model_type", None) != "unlimited_ocr":
        raise ModelLoadError(f"{folder} holds a {getattr(config, 'model_type', '?')!r} model, not unlimited_ocr")
    try:
        model, info = UnlimitedOcrForConditionalGeneration.from_pretrained(
            folder, config=config, dtype=dt, local_files_only=True, output_loading_info=True)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load weights from {folder}: {_one_line(exc)}") from exc
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelLoadError(f"weights in {folder} are incomplete: {len(missing)} missing, e.g. {missing[0]}")
    try:
        processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load processor/tokenizer from {folder}: {_one_line(exc)}") from exc

    model = model.to(dev).eval().requires_grad_(False)
    if make_official_experts_runnable(model):  # fp32/fp16 on CUDA: grouped_mm experts are bf16-only there
        logger.info("experts implementation set to 'eager' ({} on {})", dt, dev)
    tok = processor.tokenizer
    text_cfg = config.text_config
    sep = tok.convert_tokens_to_ids(PAGE_SEPARATOR)
    page_sep_id = sep if isinstance(sep, int) and sep != tok.unk_token_id and sep >= 0 else None
    eos = text_cfg.eos_token_id if text_cfg.eos_token_id is not None else tok.eos_token_id
    loaded = LoadedModel(
        model=model, processor=processor, tokenizer=tok, device=dev, dtype=dt,
        name=str(path) if not Path(str(path)).exists() else folder.name, path=str(folder),
        image_token_id=config.image_token_id,
        bos_token_id=_bos_token_id(config, tok),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else text_cfg.pad_token_id,
        page_sep_id=page_sep_id, sliding_window=text_cfg.sliding_window,
        tokens_per_page=base_tokens_per_page(processor))
    logger.info("loaded {} from {} on {} ({}) in {:.1f}s", loaded.name, folder, dev, dt,
                time.perf_counter() - start)
    return loaded


def _bos_token_id(config: Any, tokenizer: Any) -> int | None:
    text_cfg = config.text_config
    return text_cfg.bos_token_id if text_cfg.bos_token_id is not None else tokenizer.bos_token_id


@dataclass
class PageProcessor:
    """What ``engine.official.chunk_inputs`` needs of a model to build a chunk's inputs: its processor and its BOS id,
    without weights or a device (a page-preparation process loads this, never the model)."""

    processor: Any
    bos_token_id: int | None


def load_processor(path: str) -> PageProcessor:
    """The processor of the model at ``path`` (as ``load_model`` resolves it; never downloads)."""
    from transformers import AutoConfig, AutoProcessor

    folder = resolve_path(str(path))
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot load processor/tokenizer from {folder}: {_one_line(exc)}") from exc
    return PageProcessor(processor, _bos_token_id(config, processor.tokenizer))
