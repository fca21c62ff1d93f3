#!/usr/bin/env python3
"""Train the demo Unlimited-OCR model from scratch on synthetic documents (one GPU, a fixed time budget).

    python3 scripts/train_demo_model.py --out models/demo --minutes 8          # GPU run (see docs/demo_model_training.md)
    python3 scripts/train_demo_model.py --overfit-test                         # CPU: 8 word images must be read
    python3 scripts/train_demo_model.py --check-rswa                           # R-SWA scoring == generate()
    python3 scripts/train_demo_model.py --preset tiny --minutes 1 --out /tmp/d # CPU pipeline smoke run

Recipe (DESIGN section 3): the vision tower is initialised normally (not SAM's 1e-10 default) and kept frozen at
its random init for the first `--freeze-frac` of the time (default 10%) while the decoder and projector learn to
read its features; then it trains at `--vision-lr-ratio` times the decoder's rate (default 0.3; DESIGN used 0.1).
Auxiliary "which character is where" losses on the SAM patches and the vision tokens (`--aux-weight`, not saved
with the model) give the tower a direct signal (docs/demo_model_training.md says why). Samples are 1 page
(`document parsing.`) or 2-4
pages (`Multi page parsing.`, `<PAGE>` before each page), scored with the R-SWA mask (prefix global, output
window 128). DataLoader workers render pages on the fly from training seeds (>= 1,000,000); held-out seeds
(< 1,000,000) are never used for training. A replay buffer keeps the GPU busy if the workers fall behind.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.official import official_generation_config  # noqa: E402
from scripts import demo_model as dm  # noqa: E402
from scripts.demo_data import BatchPrefetcher, PagePool, PageStream, char_tensor, make_batch  # noqa: E402,F401
from scripts.synth import HELD_OUT_LIMIT, PAGE_SEPARATOR, page_arrays, strip_markup  # noqa: E402

START = time.time()


def log(msg: str, **fields) -> None:
    line = f"[{time.time() - START:7.1f}s] {msg}"
    if fields:
        line += " " + json.dumps(fields, default=lambda v: round(v, 4) if isinstance(v, float) else str(v))
    print(line, flush=True)


def loss_fn(model, ids, lengths, pixels, prefix_len, window, grad_vision, pixel_dtype, aux_head=None, grids=None,
            align=None, align_targets=None, n_image_slots: int | None = None) -> dict:
    """Under the R-SWA mask: `loss` (mean cross-entropy of the output tokens, prefix and padding excluded),
    `acc` (token accuracy), `word_acc` (accuracy on tokens that show on the page, when `align_targets` say
    which), `first_acc` (the same on the first such token after markup or a space: word starts), `aux`
    (auxiliary character/position loss, 0 without aux_head / grids), `align` and `align_acc` (guided-attention
    loss and hit rate, 0 without `align`). `grids` / `align_targets` are None when the batch
    has no character cells / no slot targets (`make_batch` decides on the CPU, so no step waits on the GPU);
    n_image_slots (all pages' slots) spares the alignment loss a host sync."""
    T = ids.shape[1]
    for head in (aux_head, align):
        if head is not None:
            head.active = True
    try:
        logits, tokens = dm.score(model, ids, dm.pixels_from_uint8(pixels, pixel_dtype), prefix_len, window,
                                  grad_vision=grad_vision, keep=T - prefix_len + 1, return_tokens=True)
    finally:
        for head in (aux_head, align):
            if head is not None:
                head.active = False
    logits = logits[:, :-1].float()
    targets = ids[:, prefix_len:]
    valid = torch.arange(prefix_len, T, device=ids.device)[None] < lengths[:, None]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    valid_f = valid.reshape(-1).float()
    right = logits.argmax(-1) == targets
    out = {"loss": (loss * valid_f).sum() / valid_f.sum(), "acc": (right & valid).sum() / valid.sum()}
    zero = torch.zeros((), device=ids.device)
    out["word_acc"] = out["first_acc"] = zero
    if align_targets is not None:
        words = align_targets[:, prefix_len - 1 : T - 1] >= 0
        out["word_acc"] = (right & words).sum() / words.sum().clamp(min=1)
        # the first page character after markup or a space: no dictionary can guess it, only reading can
        first = words & ~(align_targets[:, prefix_len - 2 : T - 2] >= 0)
        out["first_acc"] = (right & first).sum() / first.sum().clamp(min=1)
    out["aux"] = zero
    if aux_head is not None and grids is not None:
        out["aux"] = aux_head.loss(tokens, grids)
    elif aux_head is not None:
        aux_head._sam_out = None
    n_keys = None if n_image_slots is None else n_image_slots + 1
    out["align"], out["align_acc"] = align.loss(align_targets, n_keys) if align is not None else (zero, zero)
    return out


def vision_loss(model, pixels, pixel_dtype, aux_head, grids) -> dict:
    """The vision-only phase (`--vision-pretrain-frac`): the auxiliary character/position losses of the vision
    tower alone, no decoder forward. Same keys as `loss_fn`, the language ones zero."""
    aux_head.active = True
    try:
        _, tokens = dm.image_embeddings(model, dm.pixels_from_uint8(pixels, pixel_dtype), True, return_tokens=True)
    finally:
        aux_head.active = False
    zero = torch.zeros((), device=pixels.device)
    if grids is None:  # scan-like pages only: no character cells to learn from
        aux_head._sam_out, aux = None, zero
    else:
        aux = aux_head.loss(tokens, grids)
    return {"loss": zero, "acc": zero, "word_acc": zero, "first_acc": zero, "aux": aux, "align": zero,
            "align_acc": zero}


# ---------------------------------------------------------------- greedy decoding (official rule)
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
    from scripts.demo_data import token_slots

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


# ---------------------------------------------------------------- training
def autocast_factory(cuda: bool):
    """A function returning a fresh autocast context: bf16 on the GPU, nothing on the CPU."""
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else \
        (lambda: torch.autocast("cpu", enabled=False))


def lr_factor(step: int, frac: float, warmup: int, floor: float = 0.05) -> float:
    return min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def build_or_resume(args, device):
    """(model, tokenizer, image_size, resumed_state)."""
    state = None
    if args.resume:
        path = Path(args.resume)
        if path.is_dir():
            from transformers import AutoTokenizer, UnlimitedOcrForConditionalGeneration

            model = UnlimitedOcrForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path)
            size = json.loads((path / "processor_config.json").read_text())["image_processor"]["size"]["height"]
            log("resumed weights", path=str(path))
            return model.to(device), tokenizer, size, {"vision_unfrozen": True}
        state = torch.load(path, map_location="cpu", weights_only=False)
        from transformers import PreTrainedTokenizerFast, UnlimitedOcrConfig, UnlimitedOcrForConditionalGeneration
        from tokenizers import Tokenizer

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(state["tokenizer"]), **state["tok_kw"])
        model = UnlimitedOcrForConditionalGeneration(UnlimitedOcrConfig.from_dict(state["config"]))
        model.load_state_dict(state["model"])
        log("resumed training state", path=str(path), step=state["step"])
        return model.to(device), tokenizer, state["image_size"], state
    preset = dict(dm.PRESETS[args.preset])
    if args.image_size:
        preset["image_size"] = args.image_size
    t = time.time()
    tokenizer = dm.build_tokenizer(dm.tokenizer_corpus(args.tokenizer_docs), preset["vocab"], args.max_token_chars)
    log("tokenizer trained", vocab=len(tokenizer), seconds=time.time() - t)
    model = dm.new_model(dm.make_config(tokenizer, preset), seed=args.seed)
    if args.vision_from:
        n = dm.copy_vision(model, args.vision_from)
        log("vision tower loaded", path=args.vision_from, tensors=n)
        return model.to(device), tokenizer, preset["image_size"], {"vision_unfrozen": True, "curriculum": True}
    return model.to(device), tokenizer, preset["image_size"], None


def vision_params(model):
    return list(model.model.vision_tower.parameters())


def raise_open_file_limit() -> None:
    """DataLoader workers pass every page through shared memory, one file descriptor each while in flight: with
    the usual soft limit of 1,024 the workers died after a minute ("Too many open files") on the CPU box. Raise the
    soft limit to the hard one, and share through the file system if that is still low."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 65536:
            torch.multiprocessing.set_sharing_strategy("file_system")
    except (ImportError, ValueError, OSError):  # Windows, or a limit we may not change
        if "file_system" in torch.multiprocessing.get_all_sharing_strategies():
            torch.multiprocessing.set_sharing_strategy("file_system")


def train(args) -> dict:
    deadline = START + args.minutes * 60
    raise_open_file_limit()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(args.seed)
    model, tokenizer, size, state = build_or_resume(args, device)
    tpp = dm.tokens_per_page(size)
    window = model.config.text_config.sliding_window
    n_params = sum(p.numel() for p in model.parameters())
    log("model", params=n_params, image_size=size, tokens_per_page=tpp, window=window, device=str(device))
    experts = dm.set_experts_implementation(model, "grouped_mm") if cuda else "eager"

    difficulty = mp.Value("d", args.start_difficulty if state is None or state.get("curriculum") else 1.0)
    stream = PageStream(tokenizer.backend_tokenizer.to_str(), size, args.scan_prob,
                        HELD_OUT_LIMIT + args.seed * 100_000_000 + (state or {}).get("step", 0) * 1000, difficulty,
                        args.kind, open_words=args.open_words, sparse=args.sparse)
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=args.workers,
                                         prefetch_factor=8 if args.workers else None, multiprocessing_context=ctx,
                                         persistent_workers=False)
    pool = PagePool(loader, args.buffer_pages, args.seed)

    pixel_dtype = torch.bfloat16 if cuda else torch.float32
    amp = autocast_factory(cuda)
    vis = set(id(p) for p in vision_params(model))
    decay = [p for p in model.parameters() if id(p) not in vis and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if id(p) not in vis and p.ndim < 2]
    vis_decay = [p for p in vision_params(model) if p.ndim >= 2]
    vis_no_decay = [p for p in vision_params(model) if p.ndim < 2]
    groups = [dict(params=decay, weight_decay=args.weight_decay, base=args.lr),
              dict(params=no_decay, weight_decay=0.0, base=args.lr),
              dict(params=vis_decay, weight_decay=args.weight_decay, base=args.lr * args.vision_lr_ratio, vision=True),
              dict(params=vis_no_decay, weight_decay=0.0, base=args.lr * args.vision_lr_ratio, vision=True)]
    aux_head = None
    if args.aux_weight > 0:
        from scripts.synth.text import N_CHAR_CLASSES

        aux_head = dm.AuxHeads(model, N_CHAR_CLASSES).to(device)
        groups.append(dict(params=list(aux_head.parameters()), weight_decay=0.0, base=args.lr))
    align = None
    if args.align_weight > 0:
        align = dm.AlignLoss(model, dm.AlignLoss.parse(args.align))
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {}))
    step, unfrozen_at, decoder_start = 0, None, None
    if state is not None and "step" in state:
        step = state["step"]
        if aux_head is not None and state.get("aux"):
            aux_head.load_state_dict(state["aux"], strict=False)  # older states have no position head
        if len(state["optimizer"]["param_groups"]) == len(groups):
            opt.load_state_dict(state["optimizer"])
    if args.vision_pretrain_frac > 0 and aux_head is None:
        raise SystemExit("--vision-pretrain-frac needs the auxiliary heads (--aux-weight > 0)")
    vision_unfrozen = bool(state and state.get("vision_unfrozen")) or args.vision_pretrain_frac > 0
    for p in vision_params(model):
        p.requires_grad_(vision_unfrozen)
    if vision_unfrozen:
        unfrozen_at = step

    eval_docs = held_out_pages(args.eval_pages, size, 900_000, kind=args.kind)
    tf_pages = teacher_forced_pages(tokenizer, 16, size, 910_000, args.kind)
    page_sep, eos, pad = tokenizer.convert_tokens_to_ids(PAGE_SEPARATOR), tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = {n: dm.prompt_ids(tokenizer, n, tpp) for n in range(1, 5)}
    train_end = deadline - args.reserve_seconds
    train_start = time.time()
    first_step = step
    log("training", until_s=round(train_end - START, 1), experts=experts, workers=args.workers)
    history, last_eval, last_log, sums, t_n = [], time.time(), time.time(), {}, 0
    last_greedy = time.time()
    rng = random.Random(args.seed + step)
    last_save, error = time.time(), None

    def progress() -> float:
        """Share of the training time gone (drives the schedules)."""
        return (time.time() - train_start) / max(1.0, train_end - train_start)

    def plan() -> tuple[bool, int]:
        """(vision-only step?, pages per sample) of the next batch; asked by the prefetch thread."""
        frac = progress()
        vision_only = frac < args.vision_pretrain_frac
        multi = 0.0 if vision_only else args.multi_frac * min(1.0, 0.5 + frac)
        return vision_only, (1 if rng.random() >= multi else rng.choice([2, 3, 4]))

    prefetch = BatchPrefetcher(
        pool, plan, lambda pages, n: make_batch(pages, n, prompts[n], page_sep, eos, pad, device, tpp),
        args.pages_per_step)

    def save(final: bool = False) -> dict:
        files = dm.save_model(model, tokenizer, Path(args.out), size)
        log("saved" if final else "saved (intermediate)", out=args.out, step=step, files=len(files),
            mbytes=sum(p.stat().st_size for p in files) / 2**20)
        return {p.name: p.stat().st_size for p in files}

    try:
        while time.time() < train_end:
            frac = progress()
            difficulty.value = 1.0 if state is not None and not state.get("curriculum") else \
                min(1.0, args.start_difficulty + (1 - args.start_difficulty) * frac / args.curriculum_frac)
            vision_only, n_pages, batch = prefetch.next()
            if not vision_only and decoder_start is None:
                decoder_start = step
                if step > first_step:
                    log("vision pre-training done; decoder training starts", step=step)
            if not vision_unfrozen and frac >= args.freeze_frac:
                vision_unfrozen, unfrozen_at = True, step
                for p in vision_params(model):
                    p.requires_grad_(True)
                log("vision tower unfrozen", step=step, lr_ratio=args.vision_lr_ratio)
            ids, lengths, pixels, grids, targets = batch
            for g in opt.param_groups:
                base = g["base"]
                if g.get("vision"):
                    f = 0.0 if not vision_unfrozen else lr_factor(step - unfrozen_at, frac, args.vision_warmup)
                    if vision_only:  # the decoder is idle: the tower takes its own rate
                        base = args.lr * args.pretrain_lr_ratio
                else:
                    f = lr_factor(step - (decoder_start if decoder_start is not None else step), frac, args.warmup)
                g["lr"] = base * f
            model.train()
            try:
                with amp():
                    if vision_only:
                        res = vision_loss(model, pixels, pixel_dtype, aux_head, grids)
                    else:
                        res = loss_fn(model, ids, lengths, pixels, len(prompts[n_pages]), window, vision_unfrozen,
                                      pixel_dtype, aux_head, grids, align, targets, n_pages * tpp)
                opt.zero_grad(set_to_none=True)
                total = res["loss"] + args.aux_weight * res["aux"] + args.align_weight * res["align"]
                if not total.requires_grad:  # a vision-only batch of scan-like pages: no character targets
                    continue
                total.backward()
            except torch.cuda.OutOfMemoryError:
                opt.zero_grad(set_to_none=True)
                res = None
                torch.cuda.empty_cache()
                log("out of memory: batch skipped", n_pages=n_pages, shape=list(ids.shape))
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            sums = {k: sums.get(k, 0.0) + v.detach() for k, v in res.items()}
            t_n += 1
            now = time.time()
            if now - last_log >= args.log_every:
                means = {k: float(v) / t_n for k, v in sums.items()}
                log("train", step=step, loss=means["loss"], tok_acc=means["acc"], word_acc=means["word_acc"],
                    first_acc=means["first_acc"],
                    aux_loss=means["aux"], align_loss=means["align"], align_acc=means["align_acc"],
                    difficulty=difficulty.value, lr=opt.param_groups[0]["lr"], fresh=pool.fresh_used,
                    replayed=pool.replayed, steps_per_s=t_n / (now - last_log))
                last_log, sums, t_n = now, {}, 0
            if now - last_eval >= args.eval_every and now + 30 < train_end:
                do_greedy = now - last_greedy >= args.greedy_every
                history.append(evaluate(model, tokenizer, tf_pages, eval_docs, tpp, window, prompts, page_sep, eos,
                                        pad, device, amp, pixel_dtype, step,
                                        greedy_pages=args.eval_pages if do_greedy else 0, max_time=12.0))
                last_eval = time.time()
                last_greedy = last_eval if do_greedy else last_greedy
            if args.out and args.save_every and time.time() - last_save >= args.save_every \
                    and time.time() + 60 < train_end:
                save()
                last_save = time.time()
    except Exception as exc:  # noqa: BLE001 - keep what was learned: evaluate and save, then fail
        import traceback

        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
        log("training stopped by an error; saving what there is", error=error)
    log("training done", step=step, seconds=time.time() - train_start)
    prefetch.close()
    pool.close()
    pool_stats = {"fresh_pages": pool.fresh_used, "replayed_pages": pool.replayed}
    budget = deadline - time.time() - 15  # keep ~15 s for saving
    try:
        final = evaluate(model, tokenizer, tf_pages, eval_docs, tpp, window, prompts, page_sep, eos, pad, device,
                         amp, pixel_dtype, step, greedy_pages=args.eval_pages if budget > 10 else 0,
                         multi=budget > 40, max_time=max(5.0, min(30.0, 0.45 * budget)))
    except Exception as exc:  # noqa: BLE001
        final = {"error": f"{type(exc).__name__}: {exc}"}
        log("final evaluation failed", **final)
    record = {"steps": step, "params": n_params, "image_size": size, "tokens_per_page": tpp,
              "preset": f"resumed from {args.resume}" if args.resume else args.preset,
              "minutes": args.minutes, "train_seconds": time.time() - train_start, **pool_stats, "final": final,
              "history": history, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "error": error}
    if args.out:
        record["files"] = save(final=True)
    if args.state:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "config": model.config.to_dict(), "tokenizer": tokenizer.backend_tokenizer.to_str(),
                    "tok_kw": dict(bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                                   pad_token=tokenizer.pad_token,
                                   additional_special_tokens=list(dm.CONTROL_TOKENS), model_max_length=32768),
                    "image_size": size, "vision_unfrozen": vision_unfrozen,
                    "aux": aux_head.state_dict() if aux_head is not None else None}, args.state)
        log("saved training state", path=args.state)
    print("RESULT " + json.dumps({k: v for k, v in record.items() if k != "history"}, default=str), flush=True)
    if error:
        raise SystemExit(1)
    return record


def evaluate(model, tokenizer, tf_pages, eval_docs, tpp, window, prompts, page_sep, eos, pad, device, amp,
             pixel_dtype, step, greedy_pages=6, multi=False, max_time=20.0):
    """Teacher-forced loss / token accuracy on 16 held-out pages, greedy CER on a few held-out pages."""
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
    log("eval", **out)
    model.train()
    return out


def model_image_size(model) -> int:
    return model.config.vision_config.sam_config.image_size


# ---------------------------------------------------------------- checks
def check_rswa(args) -> None:
    """Teacher-forced scoring with the R-SWA mask reproduces generate()'s greedy tokens at every position, for a
    single page and a 2-page prompt, alone and inside a right-padded batch; full causal scoring does not."""
    from scripts.checks import run_check_rswa

    run_check_rswa(args, log)


def overfit_test(args) -> None:
    from scripts.checks import run_overfit_test

    ok = run_overfit_test(args, log)
    sys.exit(0 if ok else 1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="model folder to write (config, safetensors, tokenizer, processor)")
    ap.add_argument("--minutes", type=float, default=8.0, help="total wall-clock budget of this run, start to saved")
    ap.add_argument("--preset", default="demo", choices=sorted(dm.PRESETS))
    ap.add_argument("--resume", help="a model folder (weights only) or a --state file (weights + optimizer)")
    ap.add_argument("--state", help="also save the full training state (.pt) here, for --resume")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--pages-per-step", type=int, default=48)
    ap.add_argument("--buffer-pages", type=int, default=6000)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--vision-lr-ratio", type=float, default=0.3,
                    help="vision-tower learning rate / decoder learning rate once unfrozen (DESIGN: 0.1 without --aux-weight)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--vision-warmup", type=int, default=100)
    ap.add_argument("--freeze-frac", type=float, default=0.1, help="share of the time with the vision tower frozen")
    ap.add_argument("--align-weight", type=float, default=1.0,
                    help="guided-attention loss weight (dm.AlignLoss); 0 turns it off")
    ap.add_argument("--align", default="1:2:here,2:2:next,3:2:next",
                    help="guided heads, LAYER:HEADS:LOOK,... (LOOK: next = the token to predict, here = the token "
                         "just read; the first HEADS heads of the layer)")
    ap.add_argument("--aux-weight", type=float, default=1.0,
                    help="weight of the auxiliary character-grid losses on the SAM patches and vision tokens (0 = off;"
                         " DESIGN's plain recipe is --aux-weight 0 --freeze-frac 0.3 --vision-lr-ratio 0.1)")
    ap.add_argument("--vision-pretrain-frac", type=float, default=0.0,
                    help="share of the time spent training the vision tower alone on the auxiliary character losses "
                         "(no decoder forward: several times more pages a second) before the decoder starts; the "
                         "tower is trainable from step 0")
    ap.add_argument("--pretrain-lr-ratio", type=float, default=1.0,
                    help="vision-tower learning rate / --lr during the vision-only phase (the decoder is idle then, "
                         "so the tower can take the full rate)")
    ap.add_argument("--start-difficulty", type=float, default=0.0)
    ap.add_argument("--curriculum-frac", type=float, default=0.4, help="difficulty reaches 1 at this share of time")
    ap.add_argument("--multi-frac", type=float, default=0.4, help="share of steps with 2-4 page samples")
    ap.add_argument("--scan-prob", type=float, default=0.2)
    ap.add_argument("--sparse", type=float, default=0.0,
                    help="share of training documents drawn as nearly empty pages (one to three elements anywhere, "
                         "rarely a header): reading a lone line lower on a page (eval_demo_model.py --sparse)")
    ap.add_argument("--open-words", type=float, default=0.0,
                    help="share of training words replaced by pseudo-words no word list holds (the model must read "
                         "them letter by letter; eval_demo_model.py --sentences measures the gap); held-out "
                         "evaluation pages keep 0")
    ap.add_argument("--kind", default="document", choices=["document", "words"],
                    help="training pages: synthetic documents, or 1-3 big words (a quick learnability probe)")
    ap.add_argument("--vision-from", help="a saved model folder whose vision tower (and projector) starts this "
                                          "fresh run; the decoder and tokenizer are new")
    ap.add_argument("--max-token-chars", type=int, default=None,
                    help="longest BPE token in characters (e.g. 4: tokens are a few glyphs, not whole words; 1: one "
                         "token per character, digit groups 0-999 still one token)")
    ap.add_argument("--image-size", type=int, default=None,
                    help="base-mode image size instead of the preset's (a multiple of 64; 2048: 32 x 32 vision tokens, "
                         "1,057 a page)")
    ap.add_argument("--tokenizer-docs", type=int, default=1500)
    ap.add_argument("--eval-every", type=float, default=60.0, help="seconds between teacher-forced held-out evals")
    ap.add_argument("--greedy-every", type=float, default=180.0, help="seconds between greedy held-out CER evals")
    ap.add_argument("--eval-pages", type=int, default=8, help="held-out pages decoded greedily per eval")
    ap.add_argument("--log-every", type=float, default=30.0)
    ap.add_argument("--save-every", type=float, default=150.0,
                    help="seconds between intermediate saves to --out (a killed run still leaves a model)")
    ap.add_argument("--reserve-seconds", type=float, default=75.0, help="kept for the final evaluation and saving")
    ap.add_argument("--check-rswa", action="store_true")
    ap.add_argument("--overfit-test", action="store_true")
    ap.add_argument("--steps", type=int, default=300, help="--overfit-test: optimizer steps")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.check_rswa:
        check_rswa(args)
    elif args.overfit_test:
        overfit_test(args)
    else:
        if not args.out and not args.state:
            sys.exit("--out DIR is required (or --state FILE)")
        train(args)


if __name__ == "__main__":
    main()
