"""Held-out evaluation of the demo model while it trains: official greedy decoding, greedy CER, teacher-forced loss.

Held-out pages come from seeds below `synth.HELD_OUT_LIMIT`, which training never draws.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from engine.official import official_generation_config
from ingest.synth.documents import HELD_OUT_LIMIT, PAGE_SEPARATOR, page_arrays, strip_markup
from scripts.train import demo_model as dm
from scripts.train.demo_data import make_batch, token_slots
from scripts.train.demo_loss import loss_fn


def greedy(model, tokenizer, pages_u8: torch.Tensor, n_pages: int, tpp: int, max_new_tokens: int,
           pixel_dtype=torch.float32, max_time: float | None = None) -> list[list[int]]:
    """Official greedy decode (no-repeat-ngram 35, window 128/1024) of a batch of samples with n_pages pages each.
    pages_u8: [B * n_pages, S, S]. All prompts have the same length, so no padding is needed."""
    device = next(model.parameters()).device
    prompt = dm.prompt_ids(tokenizer, n_pages, tpp)
    B = pages_u8.shape[0] // n_pages
    ids = torch.tensor([prompt] * B, device=device)
    ns = SimpleNamespace(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    config = official_generation_config(ns, "single" if n_pages == 1 else "multi", max_new_tokens)
    if max_time:
        config.max_time = max_time  # a time box for evaluation during training (stops all rows)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             pixel_values=dm.pixels_from_uint8(pages_u8.to(device), pixel_dtype),
                             generation_config=config)
    result = []
    for row in out[:, len(prompt):].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        result.append(row)
    return result


def decoded_text(tokenizer, ids: list[int]) -> str:
    drop = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    return tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)


def held_out_pages(n: int, size: int, seed0: int, n_pages: int = 1, kind="document"):
    """n documents of n_pages pages from held-out seeds (< HELD_OUT_LIMIT), difficulty 1."""
    assert seed0 + n <= HELD_OUT_LIMIT
    docs = [page_arrays(seed0 + k, n_pages, size, 0.0, 1.0, kind) for k in range(n)]
    return docs


def teacher_forced_pages(tokenizer, n: int, size: int, seed0: int, kind: str = "document") -> list[tuple]:
    """Held-out single pages as `make_batch` items (pixels, ids, no char grid, image slot per token)."""
    assert seed0 + n <= HELD_OUT_LIMIT
    out = []
    for k in range(n):
        for arr, label, slots in page_arrays(seed0 + k, 1, size, 0.0, 1.0, kind, slots=True):
            enc = tokenizer(label, add_special_tokens=False, return_offsets_mapping=True)
            out.append((torch.from_numpy(arr), torch.tensor(enc["input_ids"]), None,
                        token_slots(enc["offset_mapping"], slots)))
    return out


def greedy_cer(model, tokenizer, docs, tpp, pixel_dtype, max_new_per_page=900, max_time=None):
    """Mean CER and page-count agreement of greedy outputs of held-out documents (batched)."""
    n_pages = len(docs[0])
    pages = torch.stack([torch.from_numpy(a) for d in docs for a, _ in d])
    longest = max(len(tokenizer.encode(lbl, add_special_tokens=False)) for d in docs for _, lbl in d)
    outs = greedy(model, tokenizer, pages, n_pages, tpp, min(max_new_per_page, longest + 64) * n_pages, pixel_dtype,
                  max_time)
    cers, ok_pages, ended = [], 0, 0
    for d, out in zip(docs, outs):
        text = decoded_text(tokenizer, out)
        ended += bool(out) and out[-1] == tokenizer.eos_token_id
        if n_pages > 1:
            parts = [p for p in text.split(PAGE_SEPARATOR)]
            parts = parts[1:] if parts and not parts[0].strip() else parts
            ok_pages += len(parts) == n_pages
            text = " ".join(parts)
        cers.append(dm.cer(strip_markup(text), strip_markup(" ".join(lbl for _, lbl in d))))
    return {"cer": sum(cers) / len(cers), "eos": ended / len(docs), "pages_ok": ok_pages / len(docs),
            "sample": decoded_text(tokenizer, outs[0])[:160]}


def evaluate(model, tokenizer, tf_pages, eval_docs, tpp, window, prompts, page_sep, eos, pad, device, amp,
             pixel_dtype, step, greedy_pages=6, multi=False, max_time=20.0):
    """Teacher-forced loss / token accuracy on the held-out `tf_pages`, greedy CER on the first `greedy_pages` of
    `eval_docs` (and on two 4-page chunks with `multi`). Leaves the model in training mode."""
    t = time.time()
    model.eval()
    with torch.no_grad(), amp():
        ids, lengths, pixels, _, targets = make_batch(tf_pages, 1, prompts[1], page_sep, eos, pad, device, tpp)
        res = loss_fn(model, ids, lengths, pixels, len(prompts[1]), window, False, pixel_dtype,
                      align_targets=targets)
    out = {"step": step, "heldout_loss": res["loss"].item(), "heldout_tok_acc": res["acc"].item(),
           "heldout_word_acc": res["word_acc"].item(), "heldout_first_acc": res["first_acc"].item()}
    if greedy_pages:
        with amp():
            out.update({f"greedy_{k}": v for k, v in greedy_cer(model, tokenizer, eval_docs[:greedy_pages], tpp,
                                                                 pixel_dtype, max_time=max_time).items()})
        if multi:
            docs4 = held_out_pages(2, model_image_size(model), 920_000, n_pages=4)
            with amp():
                out.update({f"multi4_{k}": v for k, v in greedy_cer(model, tokenizer, docs4, tpp, pixel_dtype,
                                                                    max_time=max_time).items() if k != "sample"})
    out["seconds"] = time.time() - t
    model.train()
    return out


def model_image_size(model) -> int:
    return model.config.vision_config.sam_config.image_size
