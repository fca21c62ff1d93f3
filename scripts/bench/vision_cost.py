"""What the vision tower costs a page, counted, not timed: floating-point operations per page of each part (SAM's
windowed and global-attention layers, CLIP, the projector), the relative-position bias each global-attention layer
adds to its scores ([pages, heads, patches, patches]) and the largest module output, for a model config (default: the real
Unlimited-OCR architecture, ``UnlimitedOcrConfig()``). The model is built on PyTorch's meta device (no weights, no
memory, seconds on any CPU) and ``torch.utils.flop_counter.FlopCounterMode`` counts each matrix product and
attention as 2 operations a multiply-add. A time per page on a GPU divided into this count says how far the tower
runs from the card's peak.

    python -m scripts.bench.vision_cost --pages 8 --json $OUT/vision_cost.json
    python -m scripts.bench.vision_cost --model models/demo
    python -m scripts.bench.vision_cost --time model,sdpa,flex --device cuda --pages 8 --json $OUT/vision_time.json

``--time KINDS`` also times the engine's vision call (``engine.model.vision.image_features``) with SAM's attention run
each way (``engine.model.sam_attention``: ``model``, the model's own code; ``sdpa``, the bias as a mask; ``flex``,
FlexAttention with the bias added in the kernel), on ``--device`` in ``--dtype``, with the weights of ``--model`` or,
without one, random weights at the real size: milliseconds a page (``--repeat`` calls after ``--warmup`` untimed ones,
the first of which compiles the flex kernel), the fraction of the card's peak that makes (``--peak-tflops``), and the
largest difference of each kind's features from the model's own.

Prints a table; the last line is one JSON object (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch


def count(config, pages: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """FLOPs per page by part, the global-attention bias and the largest module output, ``pages`` pages a call."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import UnlimitedOcrForConditionalGeneration

    with torch.device("meta"):
        model = UnlimitedOcrForConditionalGeneration(config).to(dtype)
    size = config.vision_config.sam_config.image_size
    pixels = torch.empty(pages, 3, size, size, device="meta", dtype=dtype)
    largest = [0]

    def note(module, args, output):
        for t in output if isinstance(output, tuple) else (output,):
            if isinstance(t, torch.Tensor):
                largest[0] = max(largest[0], t.numel() * t.element_size())

    hooks = [m.register_forward_hook(note) for m in model.model.modules()]
    counter = FlopCounterMode(display=False, depth=None)
    with counter, torch.inference_mode():
        model.model.get_image_features(pixels, None, [0] * pages, [[1, 1]] * pages, return_dict=True)
    for h in hooks:
        h.remove()
    sam = config.vision_config.sam_config
    global_layers = set(getattr(sam, "global_attn_indexes", []) or [])
    parts = {"sam_windowed": 0, "sam_global": 0, "sam_other": 0, "clip": 0, "other": 0}
    for name, ops in counter.get_flop_counts().items():
        flops = sum(ops.values())
        layer = re.fullmatch(r".*sam_encoder\.layers\.(\d+)", name)
        if layer:
            parts["sam_global" if int(layer.group(1)) in global_layers else "sam_windowed"] += flops
        elif name.endswith("vision_encoder"):
            parts["clip"] += flops
    total = counter.get_total_flops()
    sam_total = next((sum(v.values()) for k, v in counter.get_flop_counts().items() if k.endswith("sam_encoder")), 0)
    parts["sam_other"] = sam_total - parts["sam_windowed"] - parts["sam_global"]
    parts["other"] = total - sam_total - parts["clip"]
    per_page = {k: round(v / pages / 1e9, 1) for k, v in parts.items()}
    # SAM's global attention adds a relative-position bias of [pages, heads, patches, patches] to its scores
    patches = (size // sam.patch_size) ** 2
    bias = pages * sam.num_attention_heads * patches * patches * torch.tensor([], dtype=dtype).element_size()
    return {"pages": pages, "dtype": str(dtype).removeprefix("torch."), "image_size": size,
            "gflop_per_page": round(total / pages / 1e9, 1), "gflop_per_page_by_part": per_page,
            "global_layers": sorted(global_layers), "sam_layers": sam.num_hidden_layers,
            "largest_module_output_gib": round(largest[0] / 2**30, 3), "global_bias_gib": round(bias / 2**30, 3)}


def timed(config, model_path: Path | None, kinds: list[str], pages: int, device: str, dtype: str, warmup: int,
          repeat: int, gflop_per_page: float, peak_tflops: float) -> dict:
    """Milliseconds a page of the engine's vision call with SAM's attention run each of ``kinds``."""
    import time

    from engine.model.vision import image_features

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    if model_path is not None:
        from engine.model.load import load_model

        model = load_model(str(model_path), device, {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[dtype]).model
    else:
        from transformers import UnlimitedOcrForConditionalGeneration

        config.vision_config.sam_config.initializer_range = 0.02  # (its default leaves SAM's weights near zero)
        with torch.device(device):
            model = UnlimitedOcrForConditionalGeneration(config).to(dt).eval()
    size = model.config.vision_config.sam_config.image_size
    pixels = torch.randn(pages, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device, dt)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows, reference = {}, None
    for kind in kinds:
        for _ in range(warmup):
            image_features(model, pixels, pages, False, kind)
        sync()
        t0 = time.perf_counter()
        for _ in range(repeat):
            features = image_features(model, pixels, pages, False, kind)
        sync()
        ms = 1000 * (time.perf_counter() - t0) / repeat / pages
        reference = features if reference is None else reference
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(reference, features))
        rows[kind] = {"ms_per_page": round(ms, 3), "tflops": round(gflop_per_page / ms, 1),
                      "share_of_peak": round(gflop_per_page / ms / peak_tflops, 3) if peak_tflops else None,
                      f"max_diff_from_{kinds[0]}": diff}
    from engine.model import sam_attention

    layers = sam_attention.sam_attention_layers(model, "all")
    return {"device": device, "dtype": dtype, "pages_a_call": pages, "warmup": warmup, "repeat": repeat,
            "model_attention_class": type(layers[0]).__name__ if layers else None, "kinds": rows,
            "flex_failed": sam_attention._flex_failed[:1]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a model folder (its config.json); default: the real "
                    "architecture, UnlimitedOcrConfig()")
    ap.add_argument("--pages", type=int, default=8, help="pages in one vision call (default 8, the engine's group)")
    ap.add_argument("--time", default="", help="time the vision call with these SAM attention kinds, e.g. "
                    "model,sdpa,flex (the first is the reference for the differences)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the card's dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from transformers import AutoConfig, UnlimitedOcrConfig

    config = AutoConfig.from_pretrained(args.model) if args.model else UnlimitedOcrConfig()
    result = {"benchmark": "vision_cost", "argv": sys.argv[1:] if argv is None else argv,
              "model": str(args.model) if args.model else "UnlimitedOcrConfig()", **count(config, args.pages)}
    print(f"vision tower of {result['model']}, {args.pages} pages of {result['image_size']} px a call, "
          f"{result['dtype']}:")
    for part, gflop in result["gflop_per_page_by_part"].items():
        print(f"  {part:14s} {gflop:9.1f} GFLOP a page")
    print(f"  {'total':14s} {result['gflop_per_page']:9.1f} GFLOP a page; largest module output "
          f"{result['largest_module_output_gib']} GiB, global-attention bias {result['global_bias_gib']} GiB a call")
    if args.time:
        result["timed"] = timed(config, args.model, args.time.split(","), args.pages, args.device, args.dtype,
                                args.warmup, args.repeat, result["gflop_per_page"], args.peak_tflops)
        for kind, row in result["timed"]["kinds"].items():
            print(f"  {kind:6s} {row['ms_per_page']:8.3f} ms a page, {row['tflops']:7.1f} TFLOP/s "
                  f"({row['share_of_peak']} of peak), max diff {list(row.values())[-1]:.3g}")
    line = json.dumps(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n", encoding="utf-8")
    print(line)
    return result


if __name__ == "__main__":
    main()
