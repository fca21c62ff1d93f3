"""How long one small fp32 ``linear`` takes on the GPU for each way of writing it, by step width (issue 7).

The demo model's width-8/9 verify step measured 2.1 ms against 1.1 ms at width 4 (profile_step.py --ops):
cuBLAS picks a ~30 us ``xmma_gemm_f32f32`` kernel for [8-9, 384] x [384, 384] in fp32 where width 4 takes ~6 us.
Each candidate is captured 100 times in one CUDA graph (launch cost out) and replayed; the table gives us per
call, and the max |difference| to ``F.linear`` in fp32. Ends with one JSON line.

    python scripts/profile_linear.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def candidates() -> dict:
    def rows_of(n):
        return lambda x, w: torch.cat([F.linear(x[i:i + n], w) for i in range(0, x.shape[0], n)])

    return {
        "linear": lambda x, w: F.linear(x, w),
        "transposed": lambda x, w: torch.mm(w, x.T).T,  # cuBLAS sees [out, in] x [in, T]
        "padded16": lambda x, w: F.linear(F.pad(x, (0, 0, 0, 16 - x.shape[0])), w)[: x.shape[0]]
        if x.shape[0] < 16 else F.linear(x, w),
        "rows4": rows_of(4),
        "bmv": lambda x, w: torch.matmul(w[None], x[:, :, None])[..., 0],  # T batched GEMVs
    }


def time_graph(fn, x, w, calls: int = 100, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (calls * replays)  # us per call


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="384x384,256x384,384x256,1024x384,384x1024,1927x384",
                    help="weight shapes out x in (the demo's projections, MLPs and head)")
    ap.add_argument("--widths", default="1,2,4,5,8,9,16,17")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--blas", default="cublas,cublaslt", help="torch.backends.cuda.preferred_blas_library values")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype, "us": {},
              "max_abs_diff": {}}
    names = list(candidates())
    for blas in args.blas.split(","):
        torch.backends.cuda.preferred_blas_library(blas)
        print(f"--- preferred BLAS: {blas}")
        table(args, dtype, names, record, blas)
    worst = {n: max(v for k, v in record["max_abs_diff"].items() if k.endswith("/" + n)) for n in names}
    print("max |diff| to F.linear:", worst)
    line = json.dumps(record)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    return 0


def table(args, dtype, names, record, blas) -> None:
    print(f"{'weight':>10} {'width':>5} " + " ".join(f"{n:>11}" for n in names) + "   (us per call)")
    for shape in args.shapes.split(","):
        out_f, in_f = (int(v) for v in shape.split("x"))
        w = torch.randn(out_f, in_f, device="cuda", dtype=dtype) / in_f**0.5
        for width in (int(v) for v in args.widths.split(",")):
            x = torch.randn(width, in_f, device="cuda", dtype=dtype)
            ref = F.linear(x, w)
            row = {}
            for name, fn in candidates().items():
                row[name] = round(time_graph(fn, x, w), 2)
                record["max_abs_diff"][f"{blas}/{shape}/{width}/{name}"] = float((fn(x, w) - ref).abs().max())
            record["us"][f"{blas}/{shape}/{width}"] = row
            print(f"{shape:>10} {width:>5} " + " ".join(f"{row[n]:>11.2f}" for n in names), flush=True)


if __name__ == "__main__":
    sys.exit(main())
