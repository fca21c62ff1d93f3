"""Pages per hour of one ``uflash watch`` against several on one ledger, over the same documents.

For each count in ``--workers`` (e.g. ``1,2``): a fresh ledger, inbox and outbox, the documents of
`scripts.bench.pipeline` (``--docs``, ``--doc-pages``, ``--scan``) dropped in the inbox, and that many ``uflash watch``
processes started at once, worker i on ``--devices``\\[i % len] (``cuda:0,cuda:1`` for one per GPU; one device for
several workers on one GPU), each with ``--rows`` / workers rows (``engine.max_batch``), until every document is done
or failed (or ``--max-seconds``), then stopped with SIGTERM. The ledger is a SQLite file in the setting's folder
(every worker on one machine), or ``--ledger-urls``: one empty PostgreSQL database per setting, comma-separated.
Reported per setting: pages, documents done and failed, pages stored per distinct page (none twice), the wall from the
start to the last document done, pages per hour over it and after load (from the last worker's run opening, i.e.
once every model is loaded, to the last page stored), each worker's pages (by its runs' owner), and the GPU's busy
share. Each worker runs under `scripts.bench.timeline`, so the setting also has what its engines decoded, counted as
`scripts.bench.pipeline` counts it (chunks in flight included), over the window while every worker runs: from the last
model loaded to the first worker's last trace point (``decoded_tok_s_after_load``; `decoded_together`), and the
pages-equivalent an hour at the stand-in's tokens a page. With several settings, each against the first (``x_first``
on stored pages an hour, ``x_first_decoded`` on tokens decoded a second).

    python -m scripts.bench.workers --model /tmp/standin --docs 40 --doc-pages 4-40 --scan --chunk-pages 16 \\
        --rows 128 --workers 1,2 --devices cuda:0 --mode plain --max-seconds 500 --json $OUT/workers.json

Prints a table; the last line is one JSON object (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from db.overview import ledger_counts
from db.pages import page_row_counts
from db.runs import run_ids, run_pages, runs
from db.session import Database
from ingest.config import load_settings
from scripts.bench.pipeline import (
    add_document_options,
    aware,
    config_text,
    environment,
    page_counts_of,
    write_documents,
    write_json,
)
from scripts.bench.timeline import GpuSampler


def one_setting(args, documents: list[Path], workers: int, work: Path, url: str | None) -> dict:
    folder = work / f"workers-{workers}"
    (folder / "inbox").mkdir(parents=True)
    rows = max(1, args.rows // workers)
    text = config_text(args, str(rows), args.mode)
    if url:
        text = text.replace('url = "sqlite:///uflash.db"', f'url = "{url}"')
    config = folder / "config.toml"
    config.write_text(text, encoding="utf-8")
    for d in documents:
        shutil.copy2(d, folder / "inbox" / d.name)
    devices = args.devices.split(",")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = datetime.now().astimezone()
    t0 = time.perf_counter()
    procs, logs = [], []
    settings = load_settings(config)
    with GpuSampler(devices[0]) as gpu:
        for i in range(workers):
            logs.append(open(folder / f"worker-{i}.log", "w", encoding="utf-8"))
            procs.append(subprocess.Popen([sys.executable, "-m", "scripts.bench.timeline",
                                           str(folder / f"worker-{i}.timeline.json"), "--", "--config", str(config),
                                           "watch", "--device", devices[i % len(devices)]],
                                          env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        db = Database(settings.database_url, settings.database.busy_timeout_ms)
        try:
            settled, cut = _wait(db, len(documents), procs, args.max_seconds, t0)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
    seconds = time.perf_counter() - t0
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        for i in range(workers):
            shutil.copy2(folder / f"worker-{i}.log", args.logs / f"workers-{workers}-{i}.log")
    counts = ledger_counts(db)
    copies = page_row_counts(db)
    by_run = {r: run_pages(db, r) for r in run_ids(db)}
    # a watcher opens a run again each time the queue runs dry: its pages and its load are by owner, not by run
    by_owner: dict[str, list] = {}
    first_opened: dict[str, datetime] = {}
    for run in runs(db, list(by_run)):
        by_owner.setdefault(run.owner, []).extend(by_run[run.id])
        first_opened.setdefault(run.owner, aware(run.started_at, started))
    opened = list(first_opened.values())
    db.dispose()
    pages = [p for stored in by_run.values() for p, _ in stored]
    done = [aware(d.completed_at, started) for stored in by_run.values() for _, d in stored if d.completed_at]
    last = max(done, default=None)
    wall = (last - started).total_seconds() if last and settled else seconds
    row = {"workers": workers, "rows_each": rows, "devices": [devices[i % len(devices)] for i in range(workers)],
           "pages_queued": sum(page_counts_of(documents)), "pages": len(pages), "pages_distinct": len(copies),
           "stored_twice": sum(1 for n in copies.values() if n > 1),
           "documents_done": counts["documents"].get("done", 0),
           "documents_failed": counts["documents"].get("failed", 0), "cut_at_s": cut,
           "exit_codes": [p.returncode for p in procs], "seconds": round(wall, 2),
           "pages_per_hour": round(3600 * len(pages) / max(wall, 1e-9), 1),
           "pages_by_worker": [len(v) for v in by_owner.values() if v]}
    stored = [aware(p.created_at, started) for p in pages]
    if opened and stored:
        loaded = max(opened)
        row["loaded_s"] = round((loaded - started).total_seconds(), 2)
        after = [t for t in stored if t >= loaded]
        span = (max(stored) - loaded).total_seconds()
        row["after_load_pages_per_hour"] = round(3600 * len(after) / span, 1) if span > 0 else None
    row["gpu_busy"] = gpu.busy(row.get("loaded_s"))
    traces = []
    for i in range(workers):
        timeline = folder / f"worker-{i}.timeline.json"
        traces.append(json.loads(timeline.read_text()).get("engine_trace") or [] if timeline.exists() else [])
    if opened:
        row.update(decoded_together(traces, max(opened).timestamp(), args.tokens_per_page))
    return row


def decoded_together(traces: list[list], loaded: float, tokens_per_page: int | None) -> dict:
    """Tokens the workers' engines decoded a second, together, over the window while every one of them runs: from
    ``loaded`` (the wall clock once every model is loaded) to the earliest of their last trace points (a trace point:
    wall clock, steps, tokens, rows; `scripts.bench.timeline`), each worker's count read at both ends by linear
    interpolation; with ``tokens_per_page``, the pages-equivalent an hour."""
    if not traces or any(not t or t[-1][0] <= loaded for t in traces):
        return {"decoded_tok_s_after_load": None, "decoded_omitted": "a worker's engine trace ends before the last "
                "model was loaded (or is missing): the workers never decoded together"}
    end = min(t[-1][0] for t in traces)

    def tokens_at(trace: list, when: float) -> float:
        if when <= trace[0][0]:
            return 0.0 if when < trace[0][0] else float(trace[0][2])
        for (t0, _, n0, _), (t1, _, n1, _) in zip(trace, trace[1:]):
            if t0 <= when <= t1:
                return n0 + (n1 - n0) * (when - t0) / (t1 - t0) if t1 > t0 else float(n1)
        return float(trace[-1][2])

    by_worker = [tokens_at(t, end) - tokens_at(t, loaded) for t in traces]
    rate = sum(by_worker) / (end - loaded)
    out = {"decoded_tok_s_after_load": round(rate, 1), "decoded_window_s": round(end - loaded, 1),
           "decoded_by_worker": [round(n) for n in by_worker]}
    if tokens_per_page:
        out["decoded_pages_per_hour_after_load"] = round(3600 * rate / tokens_per_page)
    return out


def _wait(db: Database, documents: int, procs: list, max_seconds: float | None, t0: float) -> tuple[bool, float | None]:
    """Until every document is done or failed: (settled, the second it was cut at or None)."""
    while True:
        counts = ledger_counts(db, limit=1)["documents"]
        if sum(counts.values()) >= documents and not set(counts) - {"done", "failed"}:
            return True, None
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            return False, max_seconds
        if all(p.poll() is not None for p in procs):
            return False, None
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_document_options(ap, docs=20, seed0=870_000)
    ap.add_argument("--workers", default="1,2", help="workers a setting, e.g. 1,2")
    ap.add_argument("--devices", default="auto", help="devices the workers take in turn, e.g. cuda:0,cuda:1")
    ap.add_argument("--rows", type=int, default=8, help="rows in all: each of N workers takes rows / N")
    ap.add_argument("--mode", default="plain")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk-pages", type=int, default=4)
    ap.add_argument("--max-tokens-per-page", type=int, default=1500)
    ap.add_argument("--tokens-per-page", type=int, default=None, help="tokens a page for pages-equivalent an hour "
                    "(default: the stand-in's, standin.json)")
    ap.add_argument("--ledger-urls", default="", help="one empty database URL a setting, comma-separated (default: "
                    "a SQLite file in each setting's folder)")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop each setting after this long")
    ap.add_argument("--formats", default="", help="[outputs] formats (default: the config's own)")
    ap.add_argument("--logs", type=Path, help="folder for each worker's log")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    standin = (Path(args.model) / "standin.json").is_file()
    args.device, args.repair, args.prepare_processes = args.devices.split(",")[0], not standin, "auto"
    if args.tokens_per_page is None and standin:
        args.tokens_per_page = json.loads((Path(args.model) / "standin.json").read_text()).get("tokens_per_page")
    counts = [int(n) for n in args.workers.split(",")]
    urls = args.ledger_urls.split(",") if args.ledger_urls else [None] * len(counts)
    if len(urls) != len(counts):
        raise SystemExit(f"{len(counts)} settings, {len(urls)} ledger URLs")
    work = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    documents = write_documents(work / "docs", args.docs, args.doc_pages, args.seed0, args.scan)
    report = {"benchmark": "bench_workers", "argv": sys.argv[1:] if argv is None else argv, "settings": [],
              "model": json.loads((Path(args.model) / "standin.json").read_text()) if standin else {"path": args.model},
              "documents": len(documents), "pages": sum(page_counts_of(documents)),
              "environment": environment(args.device)}
    report["model"].pop("first_tokens", None)
    for n, url in zip(counts, urls):
        report["settings"].append(one_setting(args, documents, n, work, url))
        write_json(args.json, report)
    first = report["settings"][0]
    print(f"\n{'workers':>7} {'rows each':>9} {'pages':>6} {'distinct':>8} {'twice':>5} {'done':>5} {'failed':>6}"
          f" {'seconds':>8} {'pages/h':>9} {'loaded p/h':>10} {'x first':>7} {'decoded/s':>9} {'x first':>7}")
    for s in report["settings"]:
        s["x_first"] = round(s["pages_per_hour"] / first["pages_per_hour"], 3) if first["pages_per_hour"] else None
        base = first.get("decoded_tok_s_after_load")
        s["x_first_decoded"] = round(s["decoded_tok_s_after_load"] / base, 3) \
            if base and s.get("decoded_tok_s_after_load") else None
        print(f"{s['workers']:>7} {s['rows_each']:>9} {s['pages']:>6} {s['pages_distinct']:>8} {s['stored_twice']:>5}"
              f" {s['documents_done']:>5} {s['documents_failed']:>6} {s['seconds']:>8.1f} {s['pages_per_hour']:>9.1f}"
              f" {s.get('after_load_pages_per_hour') or 0:>10.1f} {s['x_first'] or 0:>7.3f}"
              f" {s.get('decoded_tok_s_after_load') or 0:>9.1f} {s['x_first_decoded'] or 0:>7.3f}")
    write_json(args.json, report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
