"""The benchmarks' random-weight model (`scripts.bench.engine`, `scripts.bench.engine_scale`,
`scripts.bench.loop_stop`): the full-size architecture (or the tiny one) built directly on the device, with a synthetic
processor (random pixels a page seed) and, planted, a wide-margin successor chain (`plant_successor_chain`).
"""

from __future__ import annotations

import time

import torch

PROMPT_IDS = {"single": [12, 345, 6789, 13], "multi": [4242, 77, 901, 2345, 13]}  # stand-ins for the prompts


class Page:
    """A page stand-in: its pixels come from its seed (the synthetic processor ignores content otherwise)."""

    def __init__(self, seed: int):
        self.seed = seed

    def convert(self, mode):
        return self


class SyntheticProcessor:
    """Stands in for UnlimitedOcrProcessor: BOS + image tokens per page + prompt ids; random pixels per page seed."""

    def __init__(self, image_token_id: int, bos_id: int, tokens_per_page: int, image_size: int, vocab: int):
        self.image_token_id, self.bos_id = image_token_id, bos_id
        self.prompts = {kind: [2 + t % (vocab - 2) for t in ids] for kind, ids in PROMPT_IDS.items()}
        self.tokens_per_page, self.image_size = tokens_per_page, image_size

    def __call__(self, images, text, crop_to_patches=False, return_tensors="pt"):
        from transformers import BatchFeature

        n = len(images)
        kind = "single" if text.endswith("document parsing.") else "multi"
        ids = [self.bos_id] + [self.image_token_id] * (self.tokens_per_page * n) + self.prompts[kind]
        pixels = torch.stack([torch.randn(3, self.image_size, self.image_size,
                                          generator=torch.Generator().manual_seed(page.seed)) for page in images])
        return BatchFeature({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                             "pixel_values": pixels, "num_local_patches": [0] * n, "patches_grid": [[1, 1]] * n})


class NullTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return ""


def plant_successor_chain(model, reserved: set[int], seed: int, scale: float, cycle: int = 0,
                          entries: tuple[int, ...] = ()) -> list[int]:
    """Give the random model one wide-margin greedy path: token i is followed by succ(i), a single random cycle
    through the vocabulary (``reserved`` ids left out: EOS, BOS, the image token). The input embeddings are
    scaled by ``scale`` so that the current token's embedding dominates the residual stream, and the LM head row
    of succ(i) is set to the embedding of i: the argmax is succ(i) by a margin bf16 rounding cannot flip. Shapes,
    kernels and per-token routing are unchanged, so cost is what a random model costs.
    ``cycle`` > 0 plants a loop instead: a cycle of that many tokens, entered from each of ``entries`` (e.g. the
    prompt's last token), so that every output repeats the same ``cycle`` tokens over and over. Returns the cycle's
    tokens in order (the whole vocabulary's without ``cycle``)."""
    emb = model.get_input_embeddings().weight
    vocab = emb.shape[0]
    gen = torch.Generator().manual_seed(seed + 7)
    order = [t for t in torch.randperm(vocab, generator=gen).tolist() if t not in reserved]
    order = [t for t in order if t not in entries][:cycle] if cycle else order
    src = torch.tensor(order, device=emb.device)
    dst = torch.tensor(order[1:] + order[:1], device=emb.device)
    head = model.lm_head.weight
    head.zero_()
    head[dst] = emb[src]
    for entry in entries:
        head[order[0]] += emb[entry]
    emb.mul_(scale)
    return order


def build_model(tiny: bool, device: str, dtype: torch.dtype, seed: int = 0, plant: float = 0.0, loop: int = 0):
    """(LoadedModel, description) of a random-weight model built directly on ``device``; ``plant``: a successor chain
    of that scale (`plant_successor_chain`), ``loop`` > 0: that chain a cycle of ``loop`` tokens entered from the
    prompts, so that every chunk repeats it for ever."""
    from transformers import UnlimitedOcrConfig, UnlimitedOcrForConditionalGeneration

    from engine.model.load import LoadedModel

    if tiny:
        from engine.model.tiny import build_tokenizer, tiny_config

        config = tiny_config(build_tokenizer(), sliding_window=128)
        image_size = config.vision_config.sam_config.image_size
    else:
        config = UnlimitedOcrConfig()
        config.vision_config.sam_config.initializer_range = 0.02  # default 1e-10 leaves the SAM tower dead
        image_size = 1024
    text = config.text_config
    q = image_size // 16 // 4
    tokens_per_page = q * (q + 1) + 1
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = UnlimitedOcrForConditionalGeneration._from_config(config, dtype=dtype)
    model = model.to(device).eval().requires_grad_(False)
    eos = text.eos_token_id if text.eos_token_id is not None else 1
    bos = text.bos_token_id if text.bos_token_id is not None else 0
    processor = SyntheticProcessor(config.image_token_id, bos, tokens_per_page, image_size, text.vocab_size)
    with torch.no_grad():
        if plant:
            entries = tuple({ids[-1] for ids in processor.prompts.values()}) if loop else ()
            plant_successor_chain(model, {eos, bos, config.image_token_id}, seed, plant, cycle=loop, entries=entries)
        model.lm_head.weight[eos].zero_()  # EOS logit exactly 0: never the argmax, runs go to full length
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    loaded = LoadedModel(model=model, processor=processor, tokenizer=NullTokenizer(), device=torch.device(device),
                         dtype=dtype, name="tiny-random" if tiny else "full-size-random", path="",
                         image_token_id=config.image_token_id, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=None, page_sep_id=None, sliding_window=text.sliding_window,
                         tokens_per_page=tokens_per_page)
    desc = {"params": sum(p.numel() for p in model.parameters()), "layers": text.num_hidden_layers,
            "hidden": text.hidden_size, "experts": text.n_routed_experts, "top_k": text.num_experts_per_tok,
            "vocab": text.vocab_size, "window": text.sliding_window, "tokens_per_page": tokens_per_page,
            "build_s": round(time.perf_counter() - t0, 2), "planted_chain_scale": plant or None,
            **({"planted_loop": loop} if loop else {})}
    return loaded, desc
