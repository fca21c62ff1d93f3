"""CPU checks of the demo-model training code (``python -m scripts.train.demo --overfit-test`` and
``--check-rswa`` run them; the tests use the pieces).

- `run_overfit_test`: a tiny model must learn to read 8 fixed word images (loss far below the "ignore the
  image" level ln(8) / tokens, and greedy decoding reproduces every label), with the plain recipe: vision
  tower frozen at its random init first, then unfrozen at a 10x lower learning rate.
- `run_check_rswa`: the training-time scoring (`demo_model.score`, R-SWA mask, batched and padded) gives, at
  every output position, an argmax equal to the token generate() chose next.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

from ingest.synth.documents import PAGE_SEPARATOR, page_arrays
from scripts.train import demo_model as dm
from scripts.train.demo_data import make_batch
from scripts.train.demo_heldout import decoded_text, greedy
from scripts.train.demo_loss import loss_fn, lr_factor

WORD_SEEDS = range(8)


def word_pages(size: int, seeds=WORD_SEEDS):
    return [page_arrays(s, 1, size, kind="words")[0] for s in seeds]


def tiny_setup(labels: list[str], preset: str = "tiny", seed: int = 0, text_init: float = 0.02, window: int = 128):
    tokenizer = dm.build_tokenizer(labels * 10 + dm.tokenizer_corpus(60), dm.PRESETS[preset]["vocab"])
    model = dm.new_model(dm.make_config(tokenizer, preset, window=window, text_init=text_init), seed=seed)
    return model, tokenizer


def overfit(model, tokenizer, pages, steps: int, lr: float = 2e-3, freeze_steps: int | None = None,
            vision_lr_ratio: float = 0.1, log=None, log_every: int = 25) -> list[float]:
    """Full-batch training of single-page samples; returns the loss per step."""
    torch.manual_seed(0)
    size = model.config.vision_config.sam_config.image_size
    tpp = dm.tokens_per_page(size)
    prompt = dm.prompt_ids(tokenizer, 1, tpp)
    batch = [(torch.from_numpy(a), torch.tensor(tokenizer.encode(lbl, add_special_tokens=False))) for a, lbl in pages]
    ids, lengths, pixels, _, _ = make_batch(batch, 1, prompt, tokenizer.convert_tokens_to_ids(PAGE_SEPARATOR),
                                      tokenizer.eos_token_id, tokenizer.pad_token_id, "cpu")
    vision = list(model.model.vision_tower.parameters())
    vis_ids = {id(p) for p in vision}
    rest = [p for p in model.parameters() if id(p) not in vis_ids]
    opt = torch.optim.AdamW([dict(params=rest, base=lr), dict(params=vision, base=lr * vision_lr_ratio, vision=True)],
                            lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    freeze_steps = steps // 2 if freeze_steps is None else freeze_steps
    losses = []
    model.train()
    for step in range(steps):
        frozen = step < freeze_steps
        for p in vision:
            p.requires_grad_(not frozen)
        for g in opt.param_groups:
            start = freeze_steps if g.get("vision") else 0
            g["lr"] = 0.0 if (g.get("vision") and frozen) else g["base"] * lr_factor(step - start, 0.0, 20)
        loss = loss_fn(model, ids, lengths, pixels, len(prompt), model.config.text_config.sliding_window,
                       not frozen, torch.float32)["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log and (step % log_every == 0 or step == steps - 1):
            log("overfit", step=step, loss=loss.item(), vision="frozen" if frozen else "training")
    model.eval()
    return losses


def run_overfit_test(steps: int, log) -> bool:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    size = dm.PRESETS["tiny"]["image_size"]
    pages = word_pages(size)
    labels = [lbl for _, lbl in pages]
    model, tokenizer = tiny_setup(labels)
    n_tokens = [len(tokenizer.encode(lbl, add_special_tokens=False)) + 1 for lbl in labels]
    floor = math.log(len(pages)) / (sum(n_tokens) / len(n_tokens))
    log("overfit test", pages=len(pages), params=sum(p.numel() for p in model.parameters()), image_size=size,
        ignore_image_loss=floor, labels=[lbl.split("<|/det|>")[1] for lbl in labels])
    losses = overfit(model, tokenizer, pages, steps, log=log)
    outs = greedy(model, tokenizer, torch.stack([torch.from_numpy(a) for a, _ in pages]), 1,
                  dm.tokens_per_page(size), max(n_tokens) + 8)
    exact = 0
    for out, lbl in zip(outs, labels):
        text = decoded_text(tokenizer, out)
        exact += text == lbl
        log("decode", ok=text == lbl, got=text, want=lbl)
    # the same model through the project's loader and the official path (PDF -> render -> processor)
    with tempfile.TemporaryDirectory() as tmp:
        dm.save_model(model, tokenizer, Path(tmp) / "m", size, dtype=torch.float32)
        from engine.model.load import load_model
        from engine.official import official_generate
        from ingest.synth.documents import make_document, render_pages

        loaded = load_model(str(Path(tmp) / "m"), device="cpu", dtype="float32")
        pdf, lbls = make_document(WORD_SEEDS[0], 1, kind="words")
        res = official_generate(loaded, render_pages(pdf, size), "single", max_new_tokens=max(n_tokens) + 8)
        official_ok = res.text == lbls[0]
        log("official path (load_model + official_generate on the rendered PDF)", ok=official_ok, got=res.text)
    final = sum(losses[-5:]) / 5
    ok = final < floor / 10 and exact == len(pages) and official_ok
    log("OVERFIT TEST " + ("PASSED" if ok else "FAILED"), final_loss=final, ignore_image_loss=floor,
        exact=f"{exact}/{len(pages)}", seconds=time.time() - t0)
    return ok


def _generate_plain(model, ids, pixels, max_new):
    """Plain greedy generate() (no processors), as a list of new token ids."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, num_beams=1, eos_token_id=None,
                           pad_token_id=model.config.text_config.pad_token_id, bos_token_id=0)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                             generation_config=cfg)
    return out[0, ids.shape[1]:].tolist()


def rswa_agreement(model, tokenizer, size: int, new_tokens: int, log=None) -> int:
    """Assert that R-SWA teacher-forced scoring reproduces plain greedy generate() at every output position (1 page
    twice, then 2 pages), alone and in a right-padded batch. Returns the number of output tokens checked."""
    window = model.config.text_config.sliding_window
    tpp = dm.tokens_per_page(size)
    pages = [torch.from_numpy(a) for d in range(3) for a, _ in page_arrays(960_000 + d, 1, size)]
    results: dict[int, list] = {}
    for n_pages, page_set in ((1, [pages[0]]), (1, [pages[1]]), (2, pages[1:3])):
        prompt = dm.prompt_ids(tokenizer, n_pages, tpp)
        pixels = dm.pixels_from_uint8(torch.stack(page_set))
        gen = _generate_plain(model, torch.tensor([prompt]), pixels, new_tokens)
        results.setdefault(n_pages, []).append((prompt, gen, pixels))
    checked = 0
    for n_pages, runs in results.items():
        L = len(runs[0][0])
        for prompt, gen, pixels in runs:
            seq = torch.tensor([prompt + gen])
            with torch.no_grad():
                pred = dm.score(model, seq, pixels, L, window)[0, L - 1 : -1].argmax(-1).tolist()
                full = dm.score(model, seq, pixels, L, seq.shape[1])[0, L - 1 : -1].argmax(-1).tolist()  # causal
            mism = [i for i, (a, b) in enumerate(zip(pred, gen)) if a != b]
            if log:
                log("rswa check", pages=n_pages, generated=len(gen), mismatches=len(mism),
                    full_causal_mismatches=sum(a != b for a, b in zip(full, gen)))
            assert not mism, f"R-SWA scoring disagrees with generate() at output positions {mism[:10]}"
            checked += len(gen)
        if len(runs) > 1:  # batched, right-padded: the shorter sequence padded to the longer one
            seqs = [p + g[: len(g) - 37 * k] for k, (p, g, _) in enumerate(runs)]
            batch = torch.full((len(seqs), max(len(s) for s in seqs)), tokenizer.pad_token_id)
            for b, s in enumerate(seqs):
                batch[b, : len(s)] = torch.tensor(s)
            with torch.no_grad():
                logits = dm.score(model, batch, torch.cat([r[2] for r in runs]), L, window)
            for b, s in enumerate(seqs):
                assert logits[b, L - 1 : len(s) - 1].argmax(-1).tolist() == s[L:], f"batched row {b} differs"
            if log:
                log("rswa check batched+padded", rows=len(seqs), lengths=[len(s) for s in seqs], ok=True)
    return checked


def run_check_rswa(log, trained: tuple | None = None) -> None:
    """`rswa_agreement` on ``trained`` (model, tokenizer, image size) or on a random tiny model."""
    torch.manual_seed(0)
    if trained is not None:
        model, tokenizer, size = trained
    else:  # a random tiny model; a large text init gives long, varied greedy outputs (as engine/model/tiny.py)
        size = dm.PRESETS["tiny"]["image_size"]
        model, tokenizer = tiny_setup([lbl for _, lbl in word_pages(size)], text_init=0.2)
        with torch.no_grad():
            model.lm_head.weight[tokenizer.eos_token_id].zero_()
    model.eval()
    window = model.config.text_config.sliding_window
    checked = rswa_agreement(model, tokenizer, size, max(3 * window, 300), log)
    log("RSWA CHECK PASSED", output_tokens_checked=checked, window=window)
