"""Pages per hour through the whole pipeline: ``uflash run`` over synthetic documents, at each ``--max-batch``.

Documents: ``--docs`` held-out synthetic PDFs (``ingest.synth.documents.make_document``, seeds from ``--seed0`` below
1,000,000) of ``--doc-pages`` pages each, image-only with ``--scan`` (no text layer: the block drafter's case).
For each ``engine.max_batch`` in ``--max-batch`` (e.g. ``1,auto``) a fresh ledger, inbox and outbox, then one
``uflash run`` of every document in a subprocess (model load, graph capture and every other one-off cost
included), timed from the command's start to its exit. Reported per setting: wall seconds, pages, pages per hour,
pages per hour once the model is loaded (the run's opening in the ledger: imports and model load left out; graph
capture kept), time to the first finished document (its ledger completion time after the command's start), output
tokens, tokens per second of decoding, mean tau and the mean batch size pages were decoded in (``stats.batch_rows``).
Prints a table; the last line is one JSON object (also written to ``--json``).

    python -m scripts.bench.pipeline --docs 50 --doc-pages 4 --max-batch 1,auto --json $OUT/pipeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path


def write_documents(folder: Path, docs: int, pages: int, seed0: int, scan: bool, ladder: bool = False) -> list[Path]:
    from ingest.synth.documents import HELD_OUT_LIMIT

    if seed0 + docs > HELD_OUT_LIMIT:
        raise SystemExit(f"held-out seeds must stay below {HELD_OUT_LIMIT:,}")
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(folder / f"doc-{seed}.pdf", seed, pages, scan, ladder) for seed in range(seed0, seed0 + docs)]
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1) or 1) as pool:
        return list(pool.map(write_document, *zip(*jobs))) if jobs else []


def write_document(path: Path, seed: int, pages: int, scan: bool, ladder: bool) -> Path:
    from ingest.synth.documents import make_document
    from ingest.synth.ladder import ladder_document

    path.write_bytes(ladder_document(seed)[0] if ladder else make_document(seed, pages, scan=scan)[0])
    return path


def config_text(args, max_batch: str, mode: str) -> str:
    batch = f'"{max_batch}"' if max_batch == "auto" else max_batch
    return "\n".join([
        "[folders]", 'inbox = "inbox"', 'outbox = "outbox"', 'archive = "archive"', 'failed = "failed"',
        'logs = "logs"', "[database]", 'url = "sqlite:///uflash.db"', "[model]", f'path = "{Path(args.model).resolve()}"',
        f'device = "{args.device}"', f'dtype = "{args.dtype}"', "[engine]", f'mode = "{mode}"',
        f"max_batch = {batch}", f"max_pages_per_chunk = {args.chunk_pages}",
        f"max_tokens_per_page = {args.max_tokens_per_page}",
        *(["[outputs]", "formats = [" + ", ".join(f'"{f}"' for f in args.formats.split(",")) + "]"] if args.formats
          else []), ""])


def aware(t: datetime, like: datetime) -> datetime:
    """A ledger time (naive UTC, or aware) as an aware time comparable with ``like``."""
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).astimezone(like.tzinfo)


def one_setting(args, documents: list[Path], max_batch: str, mode: str, work: Path) -> dict:
    folder = work / f"batch-{max_batch}-{mode}"
    folder.mkdir(parents=True)
    config = folder / "config.toml"
    config.write_text(config_text(args, max_batch, mode), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = datetime.now().astimezone()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ingest.commands.cli", "--config", str(config), "run", *map(str, documents),
                           "--out", str(folder / "out")], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / f"{mode}-{max_batch}.log").write_text(proc.stderr, encoding="utf-8")
        detail = folder / "logs" / "uflash.log"  # the file log: DEBUG, millisecond times (graph captures among them)
        if detail.exists():
            (args.logs / f"{mode}-{max_batch}.debug.log").write_bytes(detail.read_bytes())
    row = {"max_batch": max_batch, "mode": mode, "exit_code": proc.returncode, "seconds": round(seconds, 2)}
    if proc.returncode != 0:
        row["stderr_tail"] = proc.stderr[-2000:]
        print(f"uflash run exited {proc.returncode}:\n{row['stderr_tail']}", file=sys.stderr, flush=True)
    try:
        with sqlite3.connect(folder / "uflash.db") as db:
            stats = [json.loads(s) for (s,) in db.execute("SELECT stats FROM pages")]
            opened = [c for (c,) in db.execute("SELECT started_at FROM runs ORDER BY id LIMIT 1")]
            done = [c for (c,) in db.execute("SELECT completed_at FROM documents WHERE completed_at IS NOT NULL")]
    except sqlite3.OperationalError as exc:  # the run never made its ledger
        row["ledger_error"] = str(exc)
        return row
    first = min((aware(datetime.fromisoformat(c), started) for c in done), default=None)
    tokens = sum(s.get("tokens", 0) for s in stats)
    decode_s = sum(s.get("verify_s", 0.0) + s.get("single_s", 0.0) + s.get("draft_s", 0.0) for s in stats)
    row.update(pages=len(stats), documents=len(done), pages_per_hour=round(3600 * len(stats) / seconds, 1),
               tokens=tokens, decode_tok_s=round(tokens / decode_s, 1) if decode_s else None,
               tau=round(statistics.mean(s.get("tau", 0.0) for s in stats), 3) if stats else None,
               batch_rows=round(statistics.mean(s.get("batch_rows", 1.0) for s in stats), 2) if stats else None,
               first_document_s=round((first - started).total_seconds(), 2) if first else None)
    # the run opens once the model is loaded: the rate from there (imports and model load left out; graph capture,
    # rendering and the first fill kept)
    loaded = aware(datetime.fromisoformat(opened[0]), started) if opened else None
    if loaded is not None and stats:
        row["loaded_s"] = round((loaded - started).total_seconds(), 2)
        row["after_load_pages_per_hour"] = round(3600 * len(stats) / max(1e-9, seconds - row["loaded_s"]), 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--docs", type=int, default=50)
    ap.add_argument("--doc-pages", type=int, default=4)
    ap.add_argument("--seed0", type=int, default=860_000)
    ap.add_argument("--scan", action="store_true", help="image-only pages (no text layer)")
    ap.add_argument("--ladder", action="store_true", help="the grades' difficulty ladder instead (ingest.synth.ladder: "
                    "1-4 pages, 9-20 pt, scans; most of it the demo model reads badly); --doc-pages is ignored")
    ap.add_argument("--max-batch", default="1,auto")
    ap.add_argument("--docs-at-batch-1", type=int, default=None,
                    help="fewer documents for max_batch 1 (its pages/hour is a rate; it is slow)")
    ap.add_argument("--mode", default="lossless", help="engine mode, or several (e.g. plain,lossless): each setting "
                    "runs once per mode")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk-pages", type=int, default=4)
    ap.add_argument("--max-tokens-per-page", type=int, default=1500)
    ap.add_argument("--formats", default="", help="[outputs] formats (default: the config's own)")
    ap.add_argument("--logs", type=Path, help="folder for each setting's logs (uflash run's stderr and its file log)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    documents = write_documents(work / "docs", args.docs, args.doc_pages, args.seed0, args.scan, args.ladder)
    report = {"benchmark": "bench_pipeline", "argv": sys.argv[1:] if argv is None else argv, "settings": []}
    for mode in args.mode.split(","):
        for max_batch in args.max_batch.split(","):
            docs = documents[: args.docs_at_batch_1] if max_batch == "1" and args.docs_at_batch_1 else documents
            report["settings"].append(one_setting(args, docs, max_batch, mode, work))
            print(json.dumps(report["settings"][-1]), flush=True)
    print(f"\n{'mode':<9}{'max_batch':>9} {'pages':>6} {'seconds':>8} {'pages/h':>9} {'loaded p/h':>11}"
          f" {'first doc s':>11} {'tok/s':>8} {'tau':>6} {'rows':>6}")
    for r in report["settings"]:
        print(f"{r['mode']:<9}{r['max_batch']:>9} {r.get('pages', 0):>6} {r['seconds']:>8.1f}"
              f" {r.get('pages_per_hour', 0):>9.1f} {r.get('after_load_pages_per_hour') or 0:>11.1f}"
              f" {r.get('first_document_s') or 0:>11.1f}"
              f" {r.get('decode_tok_s') or 0:>8.1f} {r.get('tau') or 0:>6.2f} {r.get('batch_rows') or 0:>6.2f}")
    for mode in args.mode.split(","):
        for key, name in (("pages_per_hour", "auto_over_1"), ("after_load_pages_per_hour", "after_load_auto_over_1")):
            rates = {r["max_batch"]: r.get(key) for r in report["settings"] if r["mode"] == mode}
            if rates.get("1") and rates.get("auto"):
                report.setdefault(name, {})[mode] = round(rates["auto"] / rates["1"], 2)
                print(f"{mode}: {key.replace('_', ' ')} at auto / at 1: {report[name][mode]}")
    by = {(r["mode"], r["max_batch"]): r.get("pages_per_hour") for r in report["settings"]}
    for max_batch in args.max_batch.split(","):
        if by.get(("plain", max_batch)) and by.get(("lossless", max_batch)):
            report.setdefault("lossless_over_plain", {})[max_batch] = \
                round(by[("lossless", max_batch)] / by[("plain", max_batch)], 3)
    if "lossless_over_plain" in report:
        print(f"pages/hour lossless / plain: {report['lossless_over_plain']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, separators=(",", ":")))
    return 0 if all(r["exit_code"] == 0 for r in report["settings"]) else 1


if __name__ == "__main__":
    sys.exit(main())
