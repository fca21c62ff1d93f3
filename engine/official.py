"""The official decode path: transformers `generate()` with the official prompts and no-repeat-ngram rule.

Everything the fast engine does must reproduce `official_generate` token for token.
- prompts: one `<image>` per page, then `document parsing.` (1 page) or `Multi page parsing.` (N pages);
  the tokenizer prepends BOS. Pages in base mode (crop_to_patches=False): 273 tokens each at 1024.
- greedy, `no_repeat_ngram_size=35` with `no_repeat_ngram_window_size` 128 (single) / 1024 (multi).
  The window covers the last W ids of the whole sequence (prompt + output), as in the model's
  `UnlimitedOcrSlidingWindowNoRepeatNgramLogitsProcessor`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

PROMPTS = {"single": "document parsing.", "multi": "Multi page parsing."}
NGRAM_SIZE = 35
NGRAM_WINDOW = {"single": 128, "multi": 1024}

_ELEMENT = re.compile(
    r"<\|det\|>\s*(\S+)\s*\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]\s*<\|/det\|>(.*?)(?=<\|det\|>|<PAGE>|\Z)",
    flags=re.DOTALL)


@dataclass
class DecodeResult:
    prompt_ids: list[int]
    output_ids: list[int]  # new tokens exactly as generate() returns them (a final EOS included)
    finish_reason: str  # "eos" | "length" | "repetition" (the engine stopped a loop: engine.batch.loop_watch)
    seconds: float  # wall time of generate() (vision + prefill + decode)
    text: str  # decoded output, special tokens kept, BOS/EOS/PAD removed
    prompt_kind: str = "single"
    n_pages: int = 1
    ngram_window: int = 128
    extra: dict = field(default_factory=dict)
    logprobs: list[float] = field(default_factory=list)  # per output id: log-softmax of the logits, before bans


def chunk_inputs(loaded, images: list, prompt_kind: Literal["single", "multi"], crop: bool = False):
    """Processor inputs of a chunk, on the CPU (safe to build on any thread). crop=False is base mode (the only
    mode for multi-page)."""
    if prompt_kind not in PROMPTS:
        raise ValueError(f"prompt_kind must be 'single' or 'multi', not {prompt_kind!r}")
    if not images or (prompt_kind == "single" and len(images) != 1):
        raise ValueError(f"{prompt_kind} prompt with {len(images)} images")
    text = "<image>" * len(images) + PROMPTS[prompt_kind]
    inputs = loaded.processor(images=[im.convert("RGB") for im in images], text=text,
                              crop_to_patches=crop, return_tensors="pt")
    ids = inputs["input_ids"]
    if loaded.bos_token_id is not None and ids[0, 0].item() != loaded.bos_token_id:
        bos = torch.full((1, 1), loaded.bos_token_id, dtype=ids.dtype)
        inputs["input_ids"] = torch.cat([bos, ids], 1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return inputs


def official_inputs(loaded, images: list, prompt_kind: Literal["single", "multi"], crop: bool = False):
    """`chunk_inputs` on the model's device and in its dtype (floating tensors only)."""
    return chunk_inputs(loaded, images, prompt_kind, crop).to(loaded.device, dtype=loaded.dtype)


def official_generation_config(loaded, prompt_kind: str, max_new_tokens: int):
    """Greedy + the official no-repeat-ngram rule, with every other logits-affecting option neutral."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, repetition_penalty=1.0,
        no_repeat_ngram_size=NGRAM_SIZE, bos_token_id=loaded.bos_token_id, eos_token_id=loaded.eos_token_id,
        pad_token_id=loaded.pad_token_id if loaded.pad_token_id is not None else loaded.eos_token_id)
    # custom entry read by UnlimitedOcrGenerationMixin._get_logits_processor
    config.no_repeat_ngram_window_size = NGRAM_WINDOW[prompt_kind]
    return config


def decode_text(loaded, ids: list[int]) -> str:
    drop = {loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id}
    return loaded.tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)


def official_generate(loaded, images: list, prompt_kind: Literal["single", "multi"], max_new_tokens: int,
                      crop: bool = False) -> DecodeResult:
    inputs = official_inputs(loaded, images, prompt_kind, crop=crop)
    config = official_generation_config(loaded, prompt_kind, max_new_tokens)
    prompt_len = inputs["input_ids"].shape[1]
    start = time.perf_counter()
    recorder = LogprobRecorder()
    with torch.inference_mode():
        sequences = loaded.model.generate(**inputs, generation_config=config, logits_processor=[recorder])
    seconds = time.perf_counter() - start
    output = sequences[0, prompt_len:].tolist()
    logprobs = recorder.finish(sequences)
    finish = "eos" if output and output[-1] == loaded.eos_token_id else "length"
    return DecodeResult(prompt_ids=inputs["input_ids"][0].tolist(), output_ids=output, finish_reason=finish,
                        seconds=seconds, text=decode_text(loaded, output), prompt_kind=prompt_kind,
                        n_pages=len(images), ngram_window=NGRAM_WINDOW[prompt_kind], logprobs=logprobs)


class LogprobRecorder:
    """A logits processor that changes nothing and records, per generated token, the log-softmax of the
    scores it sees at the token generate then picks. The model's mixin appends its no-repeat-ngram rule after
    the caller's processors, so these are the logits before the bans (as the engine records them); a step's
    token is known at the next call (and from the final sequences for the last one). Stays on the device
    until ``finish`` (no sync per step)."""

    def __init__(self):
        self._last: torch.Tensor | None = None  # [batch, vocab] log-softmax of the step before
        self._picked: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._pick(input_ids[:, -1])
        self._last = scores.float().log_softmax(-1)
        return scores

    def _pick(self, tokens: torch.Tensor) -> None:
        if self._last is not None:
            self._picked.append(self._last.gather(-1, tokens[:, None].to(self._last.device))[:, 0])
            self._last = None

    def finish(self, sequences: torch.Tensor) -> list[float]:
        self._pick(sequences[:, -1])
        return torch.stack(self._picked, -1)[0].tolist() if self._picked else []


def split_pages(text: str, separator: str = "<PAGE>") -> list[str]:
    """Split multi-page output into pages. The model writes the separator before each page, so an
    empty chunk before the first separator is dropped; a missing leading separator is tolerated."""
    parts = text.split(separator)
    if len(parts) > 1 and not parts[0].strip():
        parts = parts[1:]
    return [part.strip() for part in parts]


def parse_elements(page_text: str) -> list[dict]:
    """`<|det|>label [x1, y1, x2, y2]<|/det|>text` elements (boxes on a 0-999 grid)."""
    return [{"label": label, "box": [int(x1), int(y1), int(x2), int(y2)], "text": text.strip()}
            for label, x1, y1, x2, y2, text in _ELEMENT.findall(page_text)]


def rswa_mask(prefix_len: int, total_len: int, window: int, device=None) -> torch.Tensor:
    """Boolean [1, 1, T, T] R-SWA mask (True = may attend): causal, every query sees the prefix
    (positions < prefix_len) and the last `window` positions including itself. Passing it as
    `attention_mask` to a plain forward reproduces generate()'s logits (a 4D mask is used as is)."""
    q = torch.arange(total_len, device=device)[:, None]
    k = torch.arange(total_len, device=device)[None, :]
    return ((k <= q) & ((k < prefix_len) | (k > q - window)))[None, None]
