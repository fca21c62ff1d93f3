"""Train the demo Unlimited-OCR model from scratch on synthetic documents (one GPU, a fixed time budget).

    python -m scripts.train.demo --out models/demo --minutes 8          # GPU run (see docs/demo_model.md)
    python -m scripts.train.demo --overfit-test                         # CPU: 8 word images must be read
    python -m scripts.train.demo --check-rswa                           # R-SWA scoring == generate()
    python -m scripts.train.demo --preset tiny --minutes 1 --out /tmp/d --align 1:2:here,2:2:next  # CPU smoke run

Recipe: the vision tower is initialised normally (not SAM's 1e-10 default) and kept frozen at
its random init for the first `--freeze-frac` of the time (default 10%) while the decoder and projector learn to
read its features; then it trains at `--vision-lr-ratio` times the decoder's rate (default 0.3; 0.1 without the auxiliary losses).
Auxiliary "which character is where" losses on the SAM patches and the vision tokens (`--aux-weight`, not saved
with the model) give the tower a direct signal (docs/demo_model.md says why). Samples are 1 page
(`document parsing.`) or 2-4
pages (`Multi page parsing.`, `<PAGE>` before each page), scored with the R-SWA mask (prefix global, output
window 128). DataLoader workers render pages on the fly from training seeds (>= 1,000,000); held-out seeds
(< 1,000,000) are never used for training. A replay buffer keeps the GPU busy if the workers fall behind.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from ingest.synth.documents import HELD_OUT_LIMIT, PAGE_SEPARATOR  # noqa: E402
from scripts.train import demo_model as dm  # noqa: E402
from scripts.train.demo_checks import run_check_rswa, run_overfit_test  # noqa: E402
from scripts.train.demo_data import BatchPrefetcher, PagePool, PageStream, make_batch  # noqa: E402
from scripts.train.demo_heldout import evaluate, held_out_pages, teacher_forced_pages  # noqa: E402
from scripts.train.demo_loss import loss_fn, lr_factor, vision_loss  # noqa: E402

START = time.time()


def log(msg: str, **fields) -> None:
    line = f"[{time.time() - START:7.1f}s] {msg}"
    if fields:
        line += " " + json.dumps(fields, default=lambda v: round(v, 4) if isinstance(v, float) else str(v))
    print(line, flush=True)


# ---------------------------------------------------------------- training
def autocast_factory(cuda: bool):
    """A function returning a fresh autocast context: bf16 on the GPU, nothing on the CPU."""
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else \
        (lambda: torch.autocast("cpu", enabled=False))


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
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast, UnlimitedOcrConfig, UnlimitedOcrForConditionalGeneration

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
    the usual soft limit of 1,024 the workers can die within a minute ("Too many open files"). Raise the
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
    pool = PagePool(loader, args.buffer_pages, args.seed, log=log)

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
        from ingest.synth.text import N_CHAR_CLASSES

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
                log("eval", **history[-1])
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
        log("eval", **final)
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


# ---------------------------------------------------------------- checks
def check_rswa(args) -> None:
    """Teacher-forced scoring with the R-SWA mask reproduces generate()'s greedy tokens at every position, for a
    single page and a 2-page prompt, alone and inside a right-padded batch; full causal scoring does not. On a
    random tiny model, or on the ``--resume`` one."""
    trained = None
    if args.resume:
        model, tokenizer, size, _ = build_or_resume(args, torch.device("cpu"))
        trained = (model.float(), tokenizer, size)
    run_check_rswa(log, trained)


def overfit_test(args) -> None:
    sys.exit(0 if run_overfit_test(args.steps, log) else 1)


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
                    help="vision-tower learning rate / decoder learning rate once unfrozen (0.1 without --aux-weight)")
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
                         " the plain recipe without them is --aux-weight 0 --freeze-frac 0.3 --vision-lr-ratio 0.1)")
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
                         "rarely a header): reading a lone line lower on a page (scripts.eval.demo --sparse)")
    ap.add_argument("--open-words", type=float, default=0.0,
                    help="share of training words replaced by pseudo-words no word list holds (the model must read "
                         "them letter by letter; scripts.eval.demo --sentences measures the gap); held-out "
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
