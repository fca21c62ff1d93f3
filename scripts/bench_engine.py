"""GPU benchmark of the fast path (issue 6): official generate() vs plain vs lossless, side by side, one process.

Model: the full-size architecture (``UnlimitedOcrConfig()`` defaults: 12-layer MoE decoder, 64 experts top-6,
vocab 129,280, window 128, DeepEncoder) with random weights, built on the device in ``--dtype`` (bf16).
Random weights measure cost, never acceptance (docs/benchmarks.md); acceptance is set by the drafts:
- the vision tower's SAM init range is raised from its default 1e-10 to 0.02 (a normal init);
- the lm_head row of EOS is zeroed: the EOS logit is exactly 0 and never the argmax of 129,280 random logits,
  so every run, official included, goes to the full ``--tokens`` (checked: ``full_length``). No
  ``min_new_tokens`` (that would add a logits processor to generate() and change what is measured);
- ``--plant SCALE`` (use 100 at full size) plants a wide-margin successor chain (`plant_successor_chain`): plain
  random weights have near-tie logits, and in bf16 a verify of width K and a single step round differently, so
  lossless left plain's path after 13-105 tokens and the replay drafts lost their alignment (measured tau fell
  below what the error rate sets). Planted, plain, lossless and official agree token for token in bf16
  (``exact``), and acceptance follows the injected rate; shapes, kernels and per-token expert routing are
  unchanged, so cost is unchanged;
- pages are random pixel tensors fed through a stand-in processor with the real base-mode token layout
  (BOS, 273 image tokens per page, then the prompt); ``--pages 1`` uses the single-page prompt and rule
  window 128, more pages the multi-page prompt and window 1024.

Runs per chunk (pages), each timed from the host with the device synchronized, vision + prefill included:
- ``official``: ``model.generate()`` greedy with the official no-repeat-ngram config (dynamic cache);
- ``plain``: `engine.fast_decoder.FastDecoder`, no drafts (one token per step); the first ``--moe`` and
  ``--attn`` entries are the main configuration, each other entry adds ``plain[x]`` and ``lossless-10%[x]``;
- ``lossless-R%``: a replay drafter whose drafts are the official output with R% of the tokens replaced by
  wrong ones (positional: it proposes the next tokens of that sequence), R in ``--rates``;
- ``eager-plain`` (``--with-eager``): the eager engine of issue 5, for reference.
Every engine run is checked token for token against official (``exact``; in bf16 a mismatch can be a
near-tie flip, see ``match_prefix``). Then peak GPU memory of ``plain`` at each ``--mem-tokens`` length.

Prints a table; the last line is one JSON object (also written to ``--json``). Shrink with ``--quick``,
``--tokens``, ``--pages``, ``--rates``; ``--budget-s`` skips the remaining runs once spent.
``--tiny`` runs the tiny test config on the CPU (static backend, no graphs): a smoke test of this script.

    python scripts/bench_engine.py --json $OUT/bench.json                 # full: 1 and 16 pages, 2,048 tokens
    python scripts/bench_engine.py --quick --json $OUT/quick.json         # 1 page, 512 tokens
    python scripts/bench_engine.py --tiny --quick                         # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT_IDS = {"single": [12, 345, 6789, 13], "multi": [4242, 77, 901, 2345, 13]}  # stand-ins for the prompts


# --- model and inputs ---------------------------------------------------------------------------------------

class SyntheticProcessor:
    """Stands in for UnlimitedOcrProcessor: BOS + image tokens per page + prompt ids; random pixels."""

    def __init__(self, image_token_id: int, bos_id: int, tokens_per_page: int, image_size: int, vocab: int,
                 seed: int = 0):
        self.image_token_id, self.bos_id = image_token_id, bos_id
        self.prompts = {kind: [2 + t % (vocab - 2) for t in ids] for kind, ids in PROMPT_IDS.items()}
        self.tokens_per_page, self.image_size, self.seed = tokens_per_page, image_size, seed
        self._pixels: dict[int, torch.Tensor] = {}

    def __call__(self, images, text, crop_to_patches=False, return_tensors="pt"):
        from transformers import BatchFeature

        n = len(images)
        kind = "single" if text.endswith("document parsing.") else "multi"
        ids = [self.bos_id] + [self.image_token_id] * (self.tokens_per_page * n) + self.prompts[kind]
        if n not in self._pixels:
            gen = torch.Generator().manual_seed(self.seed + n)
            self._pixels[n] = torch.randn(n, 3, self.image_size, self.image_size, generator=gen)
        return BatchFeature({"input_ids": torch.tensor([ids]),
                             "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                             "pixel_values": self._pixels[n], "num_local_patches": [0] * n,
                             "patches_grid": [[1, 1]] * n})


class NullTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return ""


class Page:
    """A page stand-in: the synthetic processor ignores image content."""

    def convert(self, mode):
        return self


def plant_successor_chain(model, reserved: set[int], seed: int, scale: float) -> None:
    """Give the random model one wide-margin greedy path: token i is followed by succ(i), a single random cycle
    through the vocabulary (``reserved`` ids left out: EOS, BOS, the image token), so the output never repeats
    within a run and never emits a special token.

    The input embeddings are multiplied by ``scale`` so that the current token's embedding dominates the
    residual stream over the random layers' contributions, and the LM head row of succ(i) is set to the
    embedding of i: the argmax is succ(i) by a margin that bf16 rounding cannot flip. Layers, routing and
    every kernel stay the same shapes and sizes, so cost is what a random model costs; what changes is that a
    verify of width K and a single step agree in bf16 (without it a random model's near-tie logits flip after
    ~15-100 tokens between kernels of different widths, the replay drafts lose their alignment and
    acceptance stops following the injected error rate)."""
    emb = model.get_input_embeddings().weight
    vocab = emb.shape[0]
    gen = torch.Generator().manual_seed(seed + 7)
    order = [t for t in torch.randperm(vocab, generator=gen).tolist() if t not in reserved]
    src = torch.tensor(order, device=emb.device)
    dst = torch.tensor(order[1:] + order[:1], device=emb.device)
    head = model.lm_head.weight
    head.zero_()
    head[dst] = emb[src]
    emb.mul_(scale)


def build_model(tiny: bool, device: str, dtype: torch.dtype, seed: int = 0, plant: float = 0.0):
    """(LoadedModel, description) of a random-weight model built directly on ``device``; ``plant`` > 0 plants
    a wide-margin successor chain with that embedding scale (`plant_successor_chain`)."""
    from transformers import UnlimitedOcrConfig, UnlimitedOcrForConditionalGeneration

    from engine.model import LoadedModel

    if tiny:
        from engine.tiny import build_tokenizer, tiny_config

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
    with torch.no_grad():
        if plant:
            bos = text.bos_token_id if text.bos_token_id is not None else 0
            plant_successor_chain(model, {eos, bos, config.image_token_id}, seed, plant)
        model.lm_head.weight[eos].zero_()  # EOS logit exactly 0: never the argmax, runs go to full length
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    bos = text.bos_token_id if text.bos_token_id is not None else 0
    processor = SyntheticProcessor(config.image_token_id, bos, tokens_per_page, image_size, text.vocab_size, seed)
    loaded = LoadedModel(model=model, processor=processor, tokenizer=NullTokenizer(), device=torch.device(device),
                         dtype=dtype, name="tiny-random" if tiny else "full-size-random", path="",
                         image_token_id=config.image_token_id, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=None, page_sep_id=None, sliding_window=text.sliding_window,
                         tokens_per_page=tokens_per_page)
    params = sum(p.numel() for p in model.parameters())
    desc = {"params": params, "layers": text.num_hidden_layers, "hidden": text.hidden_size,
            "experts": text.n_routed_experts, "top_k": text.num_experts_per_tok, "vocab": text.vocab_size,
            "window": text.sliding_window, "tokens_per_page": tokens_per_page, "build_s": round(build_s, 2),
            "experts_implementation": text._experts_implementation, "attn_implementation": text._attn_implementation,
            "planted_chain_scale": plant or None}
    return loaded, desc


def environment(device: str) -> dict:
    import transformers

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "python": platform.python_version(), "cpu_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, vram_gb=round(props.total_memory / 2**30, 1),
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                   sms=props.multi_processor_count)
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


# --- drafts of controlled quality ---------------------------------------------------------------------------

class PositionalReplay:
    """Proposes the next tokens of ``source`` at the current output length (a re-run's ids, aligned by
    position). With ``source`` = official output with R% wrong tokens, a draft is wrong exactly there."""

    name = "replay"

    def __init__(self, source: list[int]):
        self.source = source

    def propose(self, committed_ids: list[int], k: int) -> list[int]:
        n = len(committed_ids)
        return self.source[n:n + k]


def corrupt(ids: list[int], rate: float, vocab: int, seed: int = 0) -> list[int]:
    """``ids`` with each token replaced, with probability ``rate``, by a different token."""
    rng = random.Random(seed)
    return [(t + 1 + rng.randrange(vocab - 1)) % vocab if rng.random() < rate else t for t in ids]


def first_difference(ids: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))


# --- runs -----------------------------------------------------------------------------------------------------

class Clock:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()

    def before_gb(self) -> float | None:
        return round(self.before / 2**30, 3) if self.cuda else None

    def peak_gb(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / 2**30, 3) if self.cuda else None


def run_official(loaded, images, tokens: int, clock: Clock) -> tuple[list[int], dict]:
    from engine.official import official_generation_config, official_inputs

    kind = "single" if len(images) == 1 else "multi"
    config = official_generation_config(loaded, kind, tokens)
    clock.reset_peak()
    t0 = time.perf_counter()
    inputs = official_inputs(loaded, images, kind)
    with torch.inference_mode():
        sequences = loaded.model.generate(**inputs, generation_config=config)
    clock.sync()
    seconds = time.perf_counter() - t0
    output = sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return output, {"tokens": len(output), "seconds": seconds, "forwards": len(output), "tau": 0.0,
                    "peak_gb": clock.peak_gb()}


def run_engine(decoder, images, tokens: int, clock: Clock) -> tuple[list[int], dict]:
    clock.reset_peak()
    t0 = time.perf_counter()
    res = decoder.generate(images, tokens)
    clock.sync()
    seconds = time.perf_counter() - t0
    s = res.extra["speculative"]
    split = {k: s.get(k, 0.0) for k in ("prefill_s", "capture_s", "draft_s", "verify_s", "single_s")}
    split["other_s"] = round(seconds - split["prefill_s"] - split["draft_s"] - split["verify_s"] - split["single_s"], 4)
    decode_s = max(seconds - split["prefill_s"], 1e-9)
    steps = max(s["forwards"] - 1, 1)
    return res.output_ids, {
        "tokens": len(res.output_ids), "seconds": seconds, "forwards": s["forwards"], "tau": s["tau"],
        "verify_rounds": s["verify_rounds"], "single_steps": s["single_steps"],
        "accepted_tokens": s["accepted_tokens"], "draft_tokens": s["draft_tokens"],
        "decode_tokens_per_s": round((len(res.output_ids) - 1) / decode_s, 2),
        "ms_per_step": round(1000 * decode_s / steps, 3), "time_split": split,
        "backend": s.get("backend", "eager"), "moe": s.get("moe"), "attn": s.get("attn"), "graphs": s.get("graphs"),
        "cache_mb": round(s["cache_bytes"] / 2**20, 1), "peak_gb": clock.peak_gb(),
        "allocated_before_gb": clock.before_gb()}


def variants(args) -> list[tuple[str, str, str, bool]]:
    """(row-name suffix, moe, attn, compiled): the main configuration first, then one change at a time."""
    main_moe, main_attn, main_compile = args.moe[0], args.attn[0], args.compile[0]
    return ([("", main_moe, main_attn, main_compile)]
            + [(f"[{m}]", m, main_attn, main_compile) for m in args.moe[1:]]
            + [(f"[{a}]", main_moe, a, main_compile) for a in args.attn[1:]]
            + [(f"[{'compiled' if c else 'uncompiled'}]", main_moe, main_attn, c) for c in args.compile[1:]])


def bench_chunk(loaded, n_pages: int, args, clock: Clock, deadline: float, log) -> dict:
    from engine.fast_decoder import FastDecoder

    images = [Page() for _ in range(n_pages)]
    vocab = loaded.model.config.text_config.vocab_size
    chunk = {"pages": n_pages, "runs": {}, "skipped": [], "errors": {}}
    runs = chunk["runs"]
    run_official(loaded, images, 8, clock)  # warm-up: kernels, allocator
    reference, row = run_official(loaded, images, args.tokens, clock)
    row.update(exact=True, match_prefix=len(reference), full_length=len(reference) == args.tokens)
    runs["official"] = row
    log(f"  official: {row['tokens']} tokens in {row['seconds']:.2f}s")
    kind = "single" if n_pages == 1 else "multi"

    decoders = {}
    for suffix, moe, attn, compile_step in variants(args):
        try:
            dec = FastDecoder(loaded, mode="lossless", k_max=args.k_max, backend=args.backend, moe=moe, attn=attn,
                              drafter_factory=lambda *_: [], compile_step=compile_step)
            t0 = time.perf_counter()
            run_engine(dec, images, 32, clock)  # warm-up; captures this prefix bucket's graphs
            chunk.setdefault("warmup_s", {})[suffix or "main"] = round(time.perf_counter() - t0, 3)
            decoders[suffix] = dec
            if dec.fallback_reason:
                chunk["errors"][f"fallback{suffix}"] = dec.fallback_reason
            if dec.static is not None and dec.static.compile_error:
                chunk["errors"][f"compile{suffix}"] = dec.static.compile_error
        except Exception as exc:  # noqa: BLE001 - record and go on with the other configurations
            chunk["errors"][f"init{suffix}"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    plan = []
    for suffix, *_ in variants(args):
        plan.append((f"plain{suffix}", suffix, None))
        for rate in (args.rates if not suffix else [r for r in args.rates if r == 10] or args.rates[:1]):
            plan.append((f"lossless-{rate}%{suffix}", suffix, rate))
    if args.with_eager:
        plan.append(("eager-plain", None, None))
    plain_ids: dict[str, list[int]] = {}
    for name, suffix, rate in plan:
        if time.perf_counter() > deadline:
            chunk["skipped"].append(name)
            continue
        try:
            if suffix is None:
                dec = FastDecoder(loaded, mode="plain", k_max=args.k_max, backend="eager")
            elif suffix not in decoders:
                continue
            else:
                dec = decoders[suffix]
                # Drafts follow this variant's own plain output: in bf16 a near-tie flip makes the engine's
                # greedy path leave official's after a few tokens (random weights, flat logits), and drafts
                # taken from official would then measure that flip rather than the set error rate.
                source = plain_ids.get(suffix, reference) if args.drafts_from == "plain" else reference
                drafts = None if rate is None else corrupt(source, rate / 100, vocab, seed=rate)
                dec.drafter_factory = ((lambda *_: []) if drafts is None
                                       else (lambda *_, d=drafts: [PositionalReplay(d)]))
            ids, row = run_engine(dec, images, args.tokens, clock)
            if dec.fallback_reason and suffix is not None:
                chunk["errors"].setdefault(f"fallback{suffix}", dec.fallback_reason)
            if rate is None and suffix is not None:
                plain_ids[suffix] = ids
            row.update(exact=ids == reference, match_prefix=first_difference(ids, reference),
                       draft_error_rate=rate, prompt_kind=kind)
            if rate is not None and suffix in plain_ids:
                row.update(draft_source=args.drafts_from, equal_to_plain=ids == plain_ids[suffix],
                           match_prefix_plain=first_difference(ids, plain_ids[suffix]))
            runs[name] = row
            log(f"  {name}: {row['tokens']} tokens in {row['seconds']:.2f}s, {row['ms_per_step']:.2f} ms/step, "
                f"tau {row['tau']:.2f}, exact {row['exact']}")
        except Exception as exc:  # noqa: BLE001
            chunk["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    base = runs["official"]["seconds"]
    plain = runs.get("plain", {}).get("seconds")
    for row in runs.values():
        row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 2)
        row["speedup_vs_official"] = round(base / row["seconds"], 3)
        row["speedup_vs_plain"] = round(plain / row["seconds"], 3) if plain else None
        row["seconds"] = round(row["seconds"], 4)
    return chunk


def bench_memory(loaded, args, clock: Clock, deadline: float, log) -> dict:
    """Peak memory of plain at each output length (1 page): R-SWA keeps it flat."""
    from engine.fast_decoder import FastDecoder

    out = {}
    dec = FastDecoder(loaded, mode="plain", k_max=args.k_max, backend=args.backend, moe=args.moe[0],
                      attn=args.attn[0], compile_step=args.compile[0])
    run_engine(dec, [Page()], 32, clock)
    for tokens in args.mem_tokens:
        if time.perf_counter() > deadline:
            out[str(tokens)] = {"skipped": True}
            continue
        ids, row = run_engine(dec, [Page()], tokens, clock)
        out[str(tokens)] = {"tokens": row["tokens"], "peak_gb": row["peak_gb"],
                            "allocated_before_gb": row["allocated_before_gb"], "seconds": round(row["seconds"], 3),
                            "ms_per_step": row["ms_per_step"], "cache_mb": row["cache_mb"]}
        log(f"  plain {tokens} tokens: peak {row['peak_gb']} GB, {row['ms_per_step']:.2f} ms/step")
    peaks = [v["peak_gb"] for v in out.values() if v.get("peak_gb")]
    if len(peaks) >= 2:
        out["ratio_last_to_first"] = round(peaks[-1] / peaks[0], 4)
    return out


def print_table(report: dict) -> None:
    env = report["environment"]
    print(f"\n{report['model']['name']} ({report['model']['params'] / 1e9:.2f}B params, {report['dtype']}) on "
          f"{env.get('gpu') or env.get('cpu')}; torch {env['torch']}, CUDA {env['cuda']}, "
          f"transformers {env['transformers']}; {report['tokens']} tokens, k_max {report['k_max']}")
    header = (f"{'pages':>5} {'run':<22}{'tok/s':>9}{'ms/step':>9}{'steps':>7}{'tau':>6}{'x offic.':>9}"
              f"{'x plain':>8}{'peak GB':>8} {'backend':<8} exact")
    print(header)
    print("-" * len(header))
    for chunk in report["chunks"]:
        for name, r in chunk["runs"].items():
            ms = r.get("ms_per_step", 1000 * r["seconds"] / max(r["forwards"], 1))
            exact = "yes" if r["exact"] else f"no ({r['match_prefix']} equal)"
            print(f"{chunk['pages']:>5} {name:<22}{r['tokens_per_s']:>9.1f}{ms:>9.2f}{r['forwards']:>7}"
                  f"{r['tau']:>6.2f}{r['speedup_vs_official']:>8.2f}x{(r['speedup_vs_plain'] or 0):>7.2f}x"
                  f"{(r['peak_gb'] or 0):>8.2f} {r.get('backend', '-'):<8} {exact}")
        for name, err in chunk["errors"].items():
            print(f"{chunk['pages']:>5} {name:<22}ERROR {err[:200]}")
        if chunk["skipped"]:
            print(f"{chunk['pages']:>5} skipped (budget): {', '.join(chunk['skipped'])}")
    for tokens, m in report.get("memory", {}).items():
        if isinstance(m, dict) and not m.get("skipped"):
            print(f"memory: plain, 1 page, {tokens} tokens: peak {m['peak_gb']} GB")
    if "ratio_last_to_first" in report.get("memory", {}):
        print(f"memory: peak ratio {report['memory']['ratio_last_to_first']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the report here too")
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (smoke test)")
    ap.add_argument("--quick", action="store_true", help="1 page, 512 tokens, rates 0/10/100, memory 256/1024")
    ap.add_argument("--tokens", type=int, help="output tokens per run (default 2048; quick 512)")
    ap.add_argument("--pages", help="comma-separated chunk sizes (default 1,16; quick 1)")
    ap.add_argument("--rates", help="comma-separated draft error rates in %% (default 0,10,30,100)")
    ap.add_argument("--moe", default="auto", help="comma-separated: auto,grouped,dense,gather,mixed (first = main; "
                    "auto is grouped in bf16)")
    ap.add_argument("--attn", default="auto", help="comma-separated decode attention: auto,sdpa,matmul (first = main)")
    ap.add_argument("--compile", default="off",
                    help="comma-separated: off,on - torch.compile the decode step before graph capture (first = main)")
    ap.add_argument("--drafts-from", choices=("plain", "official"), default="plain",
                    help="token sequence the injected-error drafts are made from (default: the same variant's plain "
                         "output, which a lossless run must reproduce; 'official' = generate()'s output)")
    ap.add_argument("--mem-tokens", help="comma-separated output lengths for peak memory (default 1024,8192)")
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--backend", default=None, help="auto|graphs|static|eager (default: graphs on CUDA, static on CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="bf16 (GPU default) or fp32 (CPU default)")
    ap.add_argument("--with-eager", action="store_true", help="also time the eager engine (slow: ~official speed)")
    ap.add_argument("--plant", type=float, default=0.0, metavar="SCALE",
                    help="plant a wide-margin successor chain with this embedding scale (0 = plain random weights; "
                         "see plant_successor_chain) so that bf16 verify and single steps agree and acceptance "
                         "follows the injected error rate")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip remaining runs after this many seconds")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s

    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16}[args.dtype or ("float32" if device == "cpu" else "bf16")]
    args.backend = args.backend or ("graphs" if device.startswith("cuda") else "static")
    args.tokens = args.tokens or (512 if args.quick else 2048)
    args.pages = [int(p) for p in (args.pages or ("1" if args.quick else "1,16")).split(",")]
    args.rates = [int(r) for r in (args.rates or ("0,10,100" if args.quick else "0,10,30,100")).split(",")]
    args.moe = args.moe.split(",")
    args.attn = args.attn.split(",")
    args.compile = [{"on": True, "off": False}[c] for c in args.compile.split(",")]
    args.mem_tokens = [int(t) for t in (args.mem_tokens or ("256,1024" if args.quick else "1024,8192")).split(",")]
    if args.tiny:
        torch.set_num_threads(1)

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    clock = Clock(device)
    loaded, model_desc = build_model(args.tiny, device, dtype, plant=args.plant)
    log(f"model built: {model_desc}")
    report = {"benchmark": "bench_engine", "argv": sys.argv[1:] if argv is None else argv,
              "environment": environment(device), "model": {"name": loaded.name, **model_desc},
              "dtype": str(dtype).removeprefix("torch."), "device": device, "tokens": args.tokens,
              "k_max": args.k_max, "drafts_from": args.drafts_from, "backend": args.backend, "moe": args.moe,
              "attn": args.attn, "compile": args.compile, "rates": args.rates,
              "weights_gb": round(torch.cuda.memory_allocated() / 2**30, 3) if clock.cuda else None,
              "chunks": [], "memory": {}}
    try:
        for n_pages in args.pages:
            log(f"chunk of {n_pages} page(s)")
            report["chunks"].append(bench_chunk(loaded, n_pages, args, clock, deadline, log))
        log("memory")
        report["memory"] = bench_memory(loaded, args, clock, deadline, log)
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        report["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, separators=(",", ":")))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
