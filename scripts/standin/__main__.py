"""Make the stand-in model folder, or check one by decoding chunks with the engine (see `scripts.standin`).

    python -m scripts.standin /tmp/standin --tokens-per-page 1000
    python -m scripts.standin /tmp/standin --check --pages 1,2,16 --mode plain --json $OUT/standin_check.json

``--check`` decodes one chunk of random pages per ``--pages`` entry, all in one batch, with the engine in ``--mode``
(its default kernels) and checks each output's shape: the pages separated by ``<PAGE>``, N tokens each, EOS at the
end, no token twice; then how the MoE router spreads the longest output over the experts (a plain forward of it as
text). Prints a table; the last line is one JSON object. Exit status 1 when a chunk is off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def make(args) -> dict:
    from scripts.standin import build_standin

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "bf16": torch.bfloat16,
             "fp32": torch.float32}[args.dtype]
    return build_standin(args.folder, args.tokens_per_page, args.max_pages, args.tiny, device, dtype, args.seed)


def check(args) -> dict:
    import numpy as np
    from PIL import Image

    from engine.batch.engine import BatchEngine
    from engine.loading import default_kernels
    from engine.model.load import load_model
    from scripts.standin import check_output

    desc = json.loads((args.folder / "standin.json").read_text())
    n = desc["tokens_per_page"]
    t0 = time.perf_counter()
    loaded = load_model(str(args.folder), args.device, args.dtype if args.dtype != "auto" else "auto")
    load_s = time.perf_counter() - t0
    engine = BatchEngine(loaded, args.mode, max_batch=len(args.pages), kernels=default_kernels(loaded))
    rng = np.random.default_rng(args.seed)
    chunks = [[Image.fromarray(rng.integers(0, 255, (220, 160, 3), dtype=np.uint8)) for _ in range(p)]
              for p in args.pages]
    requests = [engine.prepare(c, (n + 8) * len(c), key=i) for i, c in enumerate(chunks)]
    t1 = time.perf_counter()
    results = engine.run(requests)
    decode_s = time.perf_counter() - t1
    rows = [{"pages": p, "tokens": len(r.output_ids), "finish_reason": r.finish_reason,
             "problems": check_output(r.output_ids, p, n, loaded.eos_token_id, loaded.page_sep_id)}
            for p, r in zip(args.pages, results)]
    longest = max(results, key=lambda r: len(r.output_ids)).output_ids
    return {"load_s": round(load_s, 2), "decode_s": round(decode_s, 2), "mode": args.mode, "dtype": str(loaded.dtype),
            "device": str(loaded.device), "tokens_per_page": n, "chunks": rows,
            "routing": routing_spread(loaded.model, longest), "ok": all(not r["problems"] for r in rows)}


@torch.inference_mode()
def routing_spread(model, ids: list[int]) -> dict:
    """How the MoE router spreads ``ids`` (a decoded output, run as text through the model's own forward) over the
    experts, per MoE layer: the share of experts used, and the busiest expert's load over the mean (1.0: even)."""
    picks: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in model.model.language_model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda _m, _i, out: picks.append(out[2].reshape(-1).cpu())) for g in gates]
    try:
        model(input_ids=torch.tensor([ids], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    if not gates:
        return {}
    experts = gates[0].num_experts
    counts = [torch.bincount(p, minlength=experts).float() for p in picks]
    return {"tokens": len(ids), "experts": experts,
            "used_share": [round(float((c > 0).float().mean()), 3) for c in counts],
            "max_over_mean": [round(float(c.max() / c.mean()), 2) for c in counts]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--tokens-per-page", type=int, default=1000)
    ap.add_argument("--max-pages", type=int, default=32, help="pages a chunk at most (each page has its own tokens)")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (CPU tests); the same planting")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16 or fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="check an existing folder instead of making one")
    ap.add_argument("--pages", default="1,2,16", help="--check: pages of each chunk")
    ap.add_argument("--mode", default="plain", help="--check: engine mode")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.pages = [int(p) for p in args.pages.split(",") if p]
    report = {"benchmark": "standin_check" if args.check else "standin_make",
              "argv": sys.argv[1:] if argv is None else argv}
    report.update(check(args) if args.check else make(args))
    if args.check:
        print(f"\n{'pages':>5} {'tokens':>7} {'finish':>7}  problems")
        for r in report["chunks"]:
            print(f"{r['pages']:>5} {r['tokens']:>7} {r['finish_reason']:>7}  {'; '.join(r['problems']) or 'none'}")
        spread = report["routing"]
        if spread:
            print(f"MoE routing of {spread['tokens']} output tokens over {spread['experts']} experts: experts used "
                  f"{spread['used_share']}, busiest over mean {spread['max_over_mean']} (per MoE layer)")
    else:
        print(f"\nstand-in in {args.folder}: {report['params'] / 1e9:.2f}B params, {report['pages']} pages of "
              f"{report['tokens_per_page']} tokens at most a chunk; built {report['build_s']} s, planted "
              f"{report['plant_s']} s, saved {report['save_s']} s")
    report.pop("first_tokens", None)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, separators=(",", ":")))
    return 0 if report.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
