"""Page preparation alone, on the CPU: pages per second rendering scan-like PDFs, measuring each page (its ink for the
turn check, its print) and building the model's inputs (the processor, and the probes' inputs of pages that look
turned), in the worker's own thread and in 1, 2, ... page-preparation processes (``worker.prepare_processes``).

    python -m scripts.bench.prepare --pages 64 --processes 0,1,2 --json $OUT/prepare.json
    python -m scripts.bench.prepare --pages 960 --processes 0,1,4,8,15 --chunk-pages 16 --json $OUT/prepare.json

Documents: ``--distinct`` held-out synthetic scans (``ingest.synth.documents.make_document``, ``scan=True``, seeds
from ``--seed0``) of ``--chunk-pages`` pages each, ``--turned`` of their pages shown sideways or upside down (the
PDF's /Rotate: those pages are probed, so their probes' inputs are built too); made once (in ``--docs-dir``, when
given, reused). Every setting prepares the same ``--pages`` pages, as chunks of ``--chunk-pages`` cycling over the
documents, with the processor of ``--model``:
- 0 processes: this thread runs ``ingest.pages.prepare.prepare_pages`` with the processor, chunk after chunk (what a
  worker with ``prepare_processes = 0`` spends on them, in its prefetch thread and, for the processor, its main
  thread);
- N processes: an ``ingest.pages.pool.PreparePool`` of N, warmed first (its processes started, their imports and the
  processor loaded: the start-up is reported apart), then every chunk queued at once, timed from the first submit to
  the last result in this process (the copy out of shared memory included).
torch runs ``--threads`` threads in this process (1: as each preparation process). Prints a table (pages/s, the
speed-up over 0 processes, the time per page inside the processes and of the copy here, the start-up); the last line
is one JSON object (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ingest.config import OrientationSettings
from ingest.errors import ExitCode
from ingest.pages.pool import PreparePool
from ingest.pages.prepare import PageJob, PagesReady, prepare_pages
from scripts.bench.record import finish


def write_document(path: Path, seed: int, pages: int, turned: float) -> Path:
    """A held-out synthetic scan; ``turned`` of its pages shown turned (sideways or upside down, by /Rotate)."""
    import random

    import pymupdf

    from ingest.synth.documents import make_document

    if path.is_file() and path.stat().st_size:
        return path
    data, _ = make_document(seed, pages, scan=True)
    rng = random.Random(seed)
    with pymupdf.open(stream=data, filetype="pdf") as doc:
        for page in doc:
            if rng.random() < turned:
                page.set_rotation(rng.choice((90, 180, 270)))
        path.write_bytes(doc.tobytes(garbage=3, deflate=True))
    return path


def documents(folder: Path, n: int, pages: int, seed0: int, turned: float) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"scan-{pages}p-{seed}-t{turned:g}.pdf" for seed in range(seed0, seed0 + n)]
    with ProcessPoolExecutor(max_workers=max(1, min(n, os.cpu_count() or 1))) as pool:
        return list(pool.map(write_document, paths, range(seed0, seed0 + n), [pages] * n, [turned] * n))


def chunk_jobs(docs: list[Path], pages: int, chunk_pages: int) -> list[PageJob]:
    n = -(-pages // chunk_pages)
    return [PageJob(str(docs[i % len(docs)]), "pdf", 1, min(chunk_pages, pages - i * chunk_pages), 150_000_000,
                    OrientationSettings()) for i in range(n)]


def in_this_thread(jobs: list[PageJob], processor) -> dict:  # noqa: ANN001
    t0 = time.perf_counter()
    results = [prepare_pages(j, processor) for j in jobs]
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "pages": sum(len(r.pages) for r in results),
            "probes": sum(len(r.probe_inputs) for r in results), "prepare_s": sum(r.seconds for r in results),
            "prepare_cpu_s": sum(r.cpu_seconds for r in results)}


def in_processes(jobs: list[PageJob], processes: int, model: str) -> dict:
    results: list = []
    lock, all_in = threading.Lock(), threading.Event()

    def run(batch: list[PageJob], pool: PreparePool) -> float:
        results.clear()
        all_in.clear()

        def done(result) -> None:  # noqa: ANN001
            with lock:
                results.append(result)
                if len(results) == len(batch):
                    all_in.set()

        t0 = time.perf_counter()
        for j in batch:
            pool.submit(j, done)
        if not all_in.wait(3600):
            raise SystemExit("the preparation processes did not finish within an hour")
        return time.perf_counter() - t0

    with PreparePool(processes, model) as pool:
        warm = [PageJob(j.path, j.kind, 1, 1, j.max_page_pixels, j.orientation) for j in jobs[:1]] * processes
        startup = run(warm, pool)
        before = dict(pool.timing)
        seconds = run(jobs, pool)
        bad = [r for r in results if not isinstance(r, PagesReady)]
        if bad:
            raise SystemExit(f"{len(bad)} chunks not prepared: {bad[0]!r}")
        timing = {k: pool.timing[k] - before[k]
                  for k in ("prepare_s", "prepare_cpu_s", "pack_cpu_s", "receive_s", "receive_cpu_s", "restarts")}
    return {"seconds": seconds, "startup_s": startup, "pages": sum(len(r.pages) for r in results),
            "probes": sum(len(r.probe_inputs) for r in results), **timing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64, help="pages prepared per setting")
    ap.add_argument("--processes", default="0,1,2", help="settings: 0 (this thread) and process counts")
    ap.add_argument("--chunk-pages", type=int, default=16)
    ap.add_argument("--distinct", type=int, default=8, help="different documents the chunks cycle over")
    ap.add_argument("--turned", type=float, default=0.05, help="share of pages shown sideways or upside down")
    ap.add_argument("--seed0", type=int, default=870_000)
    ap.add_argument("--model", default="models/demo", help="the model folder whose processor builds the inputs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    ap.add_argument("--docs-dir", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import torch

    from engine.model.load import load_processor

    torch.set_num_threads(args.threads)
    docs = documents(args.docs_dir or Path(tempfile.mkdtemp(prefix="bench-prepare-")), args.distinct,
                     args.chunk_pages, args.seed0, args.turned)
    jobs = chunk_jobs(docs, args.pages, args.chunk_pages)
    settings = []
    for n in [int(x) for x in args.processes.split(",")]:
        row = in_this_thread(jobs, load_processor(args.model)) if n == 0 else in_processes(jobs, n, args.model)
        row = {"processes": n, **row, "pages_per_second": round(row["pages"] / row["seconds"], 2)}
        settings.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(f"processes {n}: {row['pages']} pages in {row['seconds']:.1f} s, {row['pages_per_second']:.2f} "
              f"pages/s", file=sys.stderr, flush=True)
    base = next((s["pages_per_second"] for s in settings if s["processes"] == 0), None)
    print(f"\n{'processes':>9} {'pages':>6} {'seconds':>8} {'pages/s':>8} {'x of 0':>7} {'ms/page':>8}"
          f" {'cpu ms/page':>12} {'pack cpu':>9} {'take cpu':>9} {'start-up s':>11}")
    for s in settings:
        per_page = {k: 1000 * s.get(k, 0.0) / s["pages"]
                    for k in ("prepare_s", "prepare_cpu_s", "pack_cpu_s", "receive_cpu_s")}
        ratio = f"{s['pages_per_second'] / base:7.2f}" if base else f"{'-':>7}"
        s["speed_up"] = round(s["pages_per_second"] / base, 2) if base else None
        print(f"{s['processes']:>9} {s['pages']:>6} {s['seconds']:>8.2f} {s['pages_per_second']:>8.2f} {ratio}"
              f" {per_page['prepare_s']:>8.1f} {per_page['prepare_cpu_s']:>12.1f} {per_page['pack_cpu_s']:>9.1f}"
              f" {per_page['receive_cpu_s']:>9.1f} {s.get('startup_s', 0.0):>11.1f}")
    print("(ms/page: a page's preparation (render, measures, processor), wall and processor time of the thread that "
          "did it; pack: into shared memory, in the process; take: out of it, in this process; start-up: the "
          "processes' spawn, imports and processor load)")
    report = {"benchmark": "bench_prepare", "argv": sys.argv[1:] if argv is None else argv,
              "pages": args.pages, "chunk_pages": args.chunk_pages, "turned": args.turned, "model": args.model,
              "environment": {"cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0))
                              if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                              "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                              "python": platform.python_version(), "torch": torch.__version__,
                              "machine": platform.machine()},
              "settings": settings}
    finish(report, args.json)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
