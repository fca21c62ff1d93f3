"""Crashes at scale: ``uflash watch`` killed outright (SIGKILL) several times with many chunks in flight, then let finish.

Documents: ``--docs`` held-out synthetic PDFs of ``--doc-pages`` pages (`scripts.bench.pipeline.write_documents`).
First one uninterrupted ``uflash run`` of them (the reference). Then, in a fresh ledger and inbox, ``uflash watch``
is started, and each time the ledger shows at least ``--in-flight`` chunks running (claimed, leased) it is killed with
SIGKILL and started again, ``--kills`` times (``--in-flight`` may give one count a kill, e.g. ``256,128,64``: after a
crash the queue hands its chunks back in groups half as large; a kill that cannot reach its count within ``--wait``
seconds happens at whatever is in flight then, and says so); after the last one it runs until every document is done or
failed, and is stopped with SIGTERM. Checked: every document done (none failed), each page stored once in the ledger,
every page's text equal to the reference's (bf16 on a GPU: a chunk's tokens do not depend on its batch, so the same
setting gives the same text), the inbox empty, nothing in failed/. Prints a table and ends with one JSON line
(also written to ``--json``).

    python -m scripts.bench.crash --docs 300 --doc-pages 1 --in-flight 256,128,64 --json $OUT/crash.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from db.documents import documents
from db.models import ChunkStatus, DocStatus
from db.overview import ledger_counts
from db.pages import latest_pages, page_row_counts
from db.session import Database
from ingest.config import load_settings
from scripts.bench.pipeline import config_text, environment, write_documents


def ledger_texts(config: Path) -> tuple[dict[tuple[str, int], str], Counter, dict[str, int]]:
    """(document name, page) -> the page's text; how many rows each page has; documents by status."""
    s = load_settings(config)
    db = Database(s.database_url, s.database.busy_timeout_ms, create=False)
    try:
        pages = latest_pages(db)
        names = {d.id: d.original_name for d in documents(db, {p.document_id for p in pages})}
        texts = {(names[p.document_id], p.page_index): p.text for p in pages}
        rows = Counter({(names[d], i): n for (d, i), n in page_row_counts(db).items()})
        statuses = {str(k): v for k, v in ledger_counts(db)["documents"].items()}
        return texts, rows, statuses
    finally:
        db.dispose()


def running_chunks(db: Database, pid: int | None = None) -> int:
    """Chunks running in the ledger; with ``pid``: only those whose lease that process holds (owners are
    ``host:pid:start``), not those a killed worker still seems to hold until they are taken over."""
    if pid is None:
        return int(ledger_counts(db, limit=0)["chunks"].get(ChunkStatus.RUNNING, 0))
    return sum(n for owner, n, _ in ledger_counts(db, limit=0)["leases"]
               if owner and owner.split(":")[1:2] == [str(pid)])


def start_watch(config: Path, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ingest.commands.cli", "--config", str(config), "watch"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def kill_when_in_flight(proc: subprocess.Popen, db: Database, want: int, wait: float, settle: float) -> dict:
    """SIGKILL ``proc`` ``settle`` seconds after ``want`` chunks run (or after ``wait`` seconds with what runs then):
    the worker holds them (its own leases, not those of the worker killed before it), some decoding, the rest being
    prepared."""
    t0 = time.perf_counter()
    running = 0
    while time.perf_counter() - t0 < wait and proc.poll() is None:
        running = running_chunks(db, proc.pid)
        if running >= want:
            time.sleep(settle)
            break
        time.sleep(0.1)
    running = running_chunks(db, proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return {"after_s": round(time.perf_counter() - t0, 1), "want": want, "in_flight": running, "reached": running >= want}


def wait_all_settled(db: Database, proc: subprocess.Popen, docs: int, timeout: float) -> bool:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout and proc.poll() is None:
        counts = ledger_counts(db, limit=0)["documents"]
        if counts.get(DocStatus.DONE, 0) + counts.get(DocStatus.FAILED, 0) >= docs:
            return True
        time.sleep(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--docs", type=int, default=150)
    ap.add_argument("--doc-pages", default="4")
    ap.add_argument("--seed0", type=int, default=870_000)
    ap.add_argument("--chunk-pages", type=int, default=1)
    ap.add_argument("--max-batch", default="auto")
    ap.add_argument("--mode", default="lossless")
    ap.add_argument("--prepare-processes", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="[worker] prepare_processes (0: pages prepared in the worker's thread)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens-per-page", type=int, default=1500)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--in-flight", default="64", help="kill once this many chunks are running (or one count a kill)")
    ap.add_argument("--wait", type=float, default=120.0, help="seconds a kill waits for --in-flight at most")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds from reaching the count to the kill")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds each phase may take at most")
    ap.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.scan, args.repair, args.formats = False, True, "md,json"
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-crash-"))
    docs = write_documents(work / "docs", args.docs, args.doc_pages, args.seed0, scan=False)
    t0 = time.perf_counter()

    def setting(name: str) -> Path:
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "config.toml"
        config.write_text(config_text(args, args.max_batch, args.mode), encoding="utf-8")
        return config

    ref = setting("reference")
    r = subprocess.run([sys.executable, "-m", "ingest.commands.cli", "--config", str(ref), "run", *map(str, docs)],
                       capture_output=True, text=True, timeout=args.timeout)
    ref_s = time.perf_counter() - t0
    print(f"[{ref_s:6.1f}s] reference run: exit {r.returncode}", flush=True)
    reference, _, _ = ledger_texts(ref)

    crash = setting("crashed")
    s = load_settings(crash)
    s.ensure_folders()
    for d in docs:
        (s.inbox / d.name).write_bytes(d.read_bytes())
    db = Database(s.database_url, s.database.busy_timeout_ms)
    wants = [int(x) for x in str(args.in_flight).split(",")]
    kills = []
    with open(crash.parent / "watch.log", "ab") as log:
        for k in range(args.kills):
            proc = start_watch(crash, log)
            kills.append(kill_when_in_flight(proc, db, wants[min(k, len(wants) - 1)], args.wait, args.settle))
            print(f"[{time.perf_counter() - t0:6.1f}s] kill {k + 1}: {kills[-1]}", flush=True)
        proc = start_watch(crash, log)
        settled = wait_all_settled(db, proc, len(docs), args.timeout)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    db.dispose()
    texts, rows, statuses = ledger_texts(crash)
    differ = sorted(f"{n} p{i}" for (n, i), t in reference.items() if texts.get((n, i)) != t)
    report = {
        "benchmark": "bench_crash", "argv": sys.argv[1:] if argv is None else argv, "environment": environment(
            args.device), "model": args.model, "docs": len(docs), "pages": len(reference), "kills": kills,
        "reference_exit": r.returncode, "settled": settled, "documents": statuses,
        "pages_stored": len(texts), "pages_stored_twice": sum(1 for n in rows.values() if n > 1),
        "texts_differ": differ[:20], "texts_equal": not differ and len(texts) == len(reference),
        "inbox_left": sorted(p.name for p in s.inbox.iterdir()), "failed_dir": sorted(p.name for p in s.failed.iterdir()),
        "wall_s": round(time.perf_counter() - t0, 1)}
    report["ok"] = bool(report["texts_equal"] and settled and not report["pages_stored_twice"]
                        and statuses.get(str(DocStatus.DONE), 0) == len(docs) and not report["inbox_left"]
                        and not report["failed_dir"])
    print(f"\n{'kill':>4} {'in flight':>10} {'after s':>8}")
    for k, kill in enumerate(kills, 1):
        print(f"{k:>4} {kill['in_flight']:>10} {kill['after_s']:>8}")
    print(f"documents {statuses}; pages {len(texts)}/{len(reference)}, stored twice {report['pages_stored_twice']}, "
          f"texts equal {report['texts_equal']}; inbox {len(report['inbox_left'])}, failed/ {len(report['failed_dir'])}")
    line = json.dumps(report)
    if args.json:
        args.json.write_text(line + "\n", encoding="utf-8")
    print(line)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
