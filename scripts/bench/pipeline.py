"""Pages per hour through the whole pipeline: ``uflash run`` over synthetic documents, at each ``--max-batch``.

Documents: ``--docs`` held-out synthetic PDFs (``ingest.synth.documents.make_document``, seeds from ``--seed0`` below
1,000,000) of ``--doc-pages`` pages each (``A-B``: drawn per document between A and B), image-only with ``--scan``
(no text layer: the block drafter's case). For each mode in ``--mode`` and each ``engine.max_batch`` in
``--max-batch`` (e.g. ``1,auto``) a fresh ledger, inbox and outbox, then one ``uflash run`` of every document in a
subprocess (model load, graph capture and every other one-off cost included) under `scripts.bench.timeline`, timed
from the command's start to its exit (or to ``--max-seconds``, when it is stopped as an operator would and its rates
are those of the pages stored by then). ``--model`` may be a stand-in folder (``scripts.standin``: the real model's
cost at full size); ``[quality] repair`` is then off (``--repair``), since its text fits no page's print.
``--prepare-processes`` sets ``[worker] prepare_processes`` (default "auto"; 0: pages prepared in the worker's thread).
Each chunk size in ``--chunk-pages`` (e.g. ``1,4,8,16``) is a setting of its own. ``--steady``: ``uflash watch``
instead, with the inbox kept fed (`scripts.bench.steady`) until ``--max-seconds``, and rates over the window after
the first wave. Reported per setting, after the model is loaded (the run's opening in the ledger): tokens decoded a
second from the engine's own count (chunks in flight included) and pages-equivalent an hour at ``--tokens-per-page``
(default: the stand-in's), the engine's rows, milliseconds a step, the rows over time, peak GPU memory, the GPU's busy
share (``nvidia-smi``), the time to the first stored page and document, stored pages an hour only over a run of
several waves (``WAVES_FOR_A_RATE``; else ``stored_rate_omitted`` says why), pages stored per distinct page
(``pages_distinct``: none twice), the batch shrinks after out of memory (``memory_shrinks``), mean tau, and a timeline
of where the wall went (start-up, imports, load, graph capture, page preparation, vision, prefill, decode steps,
engine host work, quality checks, finishing, ledger claims and stores; main thread and other threads apart; the decode
loop's thread outside engine steps). Prints a timeline per setting and one table for all; the last line is one JSON
object (also written to ``--json``, after each setting too).

    python -m scripts.bench.pipeline --docs 50 --doc-pages 4 --max-batch 1,auto --json $OUT/pipeline.json
    python -m scripts.bench.pipeline --model /tmp/standin --docs 95 --doc-pages 4-40 --scan --chunk-pages 16 \
        --docs-dir /tmp/docs --max-batch auto --mode plain --max-seconds 540 --json $OUT/pipeline_standin_plain.json
    python -m scripts.bench.pipeline --model /tmp/standin250 --docs 95 --doc-pages 4-40 --scan --chunk-pages 16 \
        --docs-dir /tmp/docs --max-batch auto --mode plain --steady --max-seconds 420 --json $OUT/steady.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from db.runs import get_run, run_ids, run_pages
from db.session import Database
from ingest.config import load_settings
from ingest.errors import ExitCode
from scripts.bench.steady import InboxFeeder, steady_window
from scripts.bench.timeline import GpuSampler, print_timeline

WAVES_FOR_A_RATE = 3  # stored pages an hour only over a run that stored this many times the engine's rows in chunks


def page_counts(spec: str, docs: int, seed0: int) -> list[int]:
    """``--doc-pages``: ``N`` pages each, or ``A-B``: between A and B pages, drawn per document from its seed."""
    low, _, high = spec.partition("-")
    return [int(low) if not high else random.Random(seed).randint(int(low), int(high))
            for seed in range(seed0, seed0 + docs)]


def write_documents(folder: Path, docs: int, pages: str, seed0: int, scan: bool, ladder: bool = False) -> list[Path]:
    from ingest.synth.documents import HELD_OUT_LIMIT

    if seed0 + docs > HELD_OUT_LIMIT:
        raise SystemExit(f"held-out seeds must stay below {HELD_OUT_LIMIT:,}")
    folder.mkdir(parents=True, exist_ok=True)
    counts = page_counts(str(pages), docs, seed0)
    kind = "ladder" if ladder else f"{'scan' if scan else 'text'}-{pages}"
    jobs = [(folder / f"doc-{kind}-{seed}.pdf", seed, n, scan, ladder)
            for seed, n in zip(range(seed0, seed0 + docs), counts)]
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1) or 1) as pool:
        return list(pool.map(write_document, *zip(*jobs))) if jobs else []


def write_document(path: Path, seed: int, pages: int, scan: bool, ladder: bool) -> Path:
    from ingest.synth.documents import make_document
    from ingest.synth.ladder import ladder_document

    if not (path.is_file() and path.stat().st_size):  # --docs-dir: made once, reused by later calls
        path.write_bytes(ladder_document(seed)[0] if ladder else make_document(seed, pages, scan=scan)[0])
    return path


def config_text(args, max_batch: str, mode: str, chunk_pages: int | None = None) -> str:
    batch = f'"{max_batch}"' if max_batch == "auto" else max_batch
    chunk_pages = chunk_pages or int(str(args.chunk_pages).split(",")[0])
    return "\n".join([
        "[folders]", 'inbox = "inbox"', 'outbox = "outbox"', 'archive = "archive"', 'failed = "failed"',
        'logs = "logs"', "[database]", 'url = "sqlite:///uflash.db"', "[model]", f'path = "{Path(args.model).resolve()}"',
        f'device = "{args.device}"', f'dtype = "{args.dtype}"', "[engine]", f'mode = "{mode}"',
        f"max_batch = {batch}", f"max_pages_per_chunk = {chunk_pages}",
        f"max_tokens_per_page = {args.max_tokens_per_page}",
        f'vision_attention = "{getattr(args, "vision_attention", "auto")}"',
        f'vision_ahead = "{getattr(args, "vision_ahead", "auto")}"',
        *([] if args.repair else ["[quality]", "repair = false"]),
        "[worker]", f"prepare_processes = {json.dumps(args.prepare_processes)}",
        *(["[watch]", "settle_seconds = 0.5", "rescan_seconds = 5"] if getattr(args, "steady", False) else []),
        *(["[outputs]", "formats = [" + ", ".join(f'"{f}"' for f in args.formats.split(",")) + "]"] if args.formats
          else []), ""])


def aware(t: datetime, like: datetime) -> datetime:
    """A ledger time (naive UTC, or aware) as an aware time comparable with ``like``."""
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).astimezone(like.tzinfo)


def one_setting(args, documents: list[Path], max_batch: str, mode: str, work: Path, chunk_pages: int) -> dict:
    folder = work / f"batch-{max_batch}-{mode}-{chunk_pages}p"
    folder.mkdir(parents=True)
    config = folder / "config.toml"
    config.write_text(config_text(args, max_batch, mode, chunk_pages), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    timeline = folder / "timeline.json"
    command = ["watch"] if args.steady else ["run", *map(str, documents), "--out", str(folder / "out")]
    cmd = [sys.executable, "-m", "scripts.bench.timeline", str(timeline), "--", "--config", str(config), *command]
    settings = load_settings(config)
    feeder = None
    if args.steady:  # the inbox fed while the watcher runs (scripts.bench.steady)
        settings.ensure_folders()
        feeder = InboxFeeder(settings.inbox, documents, page_counts_of(documents),
                             Database(settings.database_url, settings.database.busy_timeout_ms), args.steady_backlog)
    started = datetime.now().astimezone()
    t0 = time.perf_counter()
    with GpuSampler(args.device) as gpu, feeder or contextlib.nullcontext():
        proc, cut = run_until(cmd, env, args.max_seconds)
    seconds = time.perf_counter() - t0
    if feeder is not None:
        feeder.db.dispose()
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / f"{mode}-{max_batch}.log").write_text(proc.stderr, encoding="utf-8")
        detail = folder / "logs" / "uflash.log"  # the file log: DEBUG, millisecond times (graph captures among them)
        if detail.exists():
            (args.logs / f"{mode}-{max_batch}.debug.log").write_bytes(detail.read_bytes())
    row = {"max_batch": max_batch, "mode": mode, "chunk_pages": chunk_pages, "exit_code": proc.returncode,
           "seconds": round(seconds, 2), "cut_at_s": cut, "steady": args.steady,
           "pages_queued": sum(feeder.fed) if feeder else sum(page_counts_of(documents))}
    if feeder is not None:
        row.update(files_fed=len(feeder.fed), feeder_error=feeder.error)
    if timeline.exists():
        row["timeline"] = json.loads(timeline.read_text())
        row["timeline"]["startup_s"] = round(seconds - row["timeline"]["wall_s"], 3)  # interpreter start, exit
    if proc.returncode != 0:
        row["stderr_tail"] = proc.stderr[-2000:]
        print(f"uflash run exited {proc.returncode}:\n{row['stderr_tail']}", file=sys.stderr, flush=True)
    db = Database(settings.database_url, settings.database.busy_timeout_ms, create=False)
    try:  # the ledger of this setting's runs, through db/ (a SQLite file or a PostgreSQL server alike; a watcher
        # opens a run again each time its queue runs dry)
        run_ids_ = run_ids(db)
        pages = [p for r in run_ids_ for p in run_pages(db, r)]
        run = get_run(db, run_ids_[0]) if run_ids_ else None
    except Exception as exc:  # the run never made its ledger (db/ raises the driver's error)
        row["ledger_error"] = str(exc)
        return row
    finally:
        db.dispose()
    stats = [page.stats or {} for page, _ in pages]
    done = list({doc.id: doc.completed_at for _, doc in pages if doc.completed_at is not None}.values())
    opened = [run.started_at] if run is not None else []
    first = min((aware(c, started) for c in done), default=None)
    first_page = min((aware(page.created_at, started) for page, _ in pages), default=None)
    tokens = sum(s.get("tokens", 0) for s in stats)
    row.update(pages=len(stats), pages_distinct=len({(doc.id, page.page_index) for page, doc in pages}),
               memory_shrinks=proc.stderr.count("batch limited to"),
               documents=len(done), tokens=tokens,
               tau=round(statistics.mean(s.get("tau", 0.0) for s in stats), 3) if stats else None,
               batch_rows=round(statistics.mean(s.get("batch_rows", 1.0) for s in stats), 2) if stats else None,
               first_document_s=round((first - started).total_seconds(), 2) if first else None,
               first_page_s=round((first_page - started).total_seconds(), 2) if first_page else None)
    # the run opens once the model is loaded: the rate from there (imports and model load left out; graph capture,
    # rendering and the first fill kept)
    loaded = aware(opened[0], started) if opened else None
    if loaded is not None:
        row["loaded_s"] = round((loaded - started).total_seconds(), 2)
    row["gpu_busy"] = gpu.busy(row.get("loaded_s"))
    timeline = row.get("timeline") or {}
    engine = timeline.get("engine", {})
    row.update(decoded_rates(timeline.get("engine_trace") or [], started.timestamp(), row.get("loaded_s"),
                             args.tokens_per_page))
    if "decoded" in engine:  # the engines' own count (the trace's last point may be older)
        row["decoded_tokens"] = engine["decoded"]
    row.update(engine_rows=engine.get("rows"), ms_per_step=round(1000 * engine["steps_s"] / engine["steps"], 2)
               if engine.get("steps") else None, cuda_peak_gib=timeline.get("cuda_peak_gib"),
               main_outside_steps=timeline.get("main_outside_steps"))
    if row.get("decoded_tok_s_after_load") and args.equivalent_tokens:
        row[f"decoded_pages_per_hour_at_{args.equivalent_tokens}"] = round(
            3600 * row["decoded_tok_s_after_load"] / args.equivalent_tokens)
    chunks = {}  # chunk id -> (second stored after the start, pages)
    for page, _ in pages:
        t = (aware(page.created_at, started) - started).total_seconds()
        c = chunks.setdefault((page.stats or {}).get("chunk_id"), [t, 0])
        c[0], c[1] = max(c[0], t), c[1] + 1
    stored = [(t, cid or 0, n) for cid, (t, n) in chunks.items()]
    row.update(stored_rates(stored, row, engine.get("rows"), seconds))
    if args.steady:
        row.update(steady_window(stored, [[p[0] - started.timestamp(), *p[1:]] for p in
                                          timeline.get("engine_trace") or []], engine.get("rows"),
                                 cut or seconds, args.tokens_per_page))
    return row


def stored_rates(stored: list[tuple[float, int, int]], row: dict, rows: int | None, seconds: float) -> dict:
    """Stored pages an hour (over the run, and after load), only when the run stored several waves of chunks (at
    least ``WAVES_FOR_A_RATE`` times the engine's rows): over one wave the figure is when the wave ended, not a rate."""
    waves = round(len(stored) / rows, 2) if rows else None
    out: dict = {"chunks_stored": len(stored), "waves": waves}
    if waves is None or waves < WAVES_FOR_A_RATE:
        out["stored_rate_omitted"] = (f"{len(stored)} chunks stored by {rows} rows: {waves} waves, fewer than "
                                      f"{WAVES_FOR_A_RATE}; the decoded rate is the figure")
        return out
    pages = sum(n for *_, n in stored)
    out["pages_per_hour"] = round(3600 * pages / seconds, 1)
    if row.get("loaded_s") is not None:
        out["after_load_pages_per_hour"] = round(3600 * pages / max(1e-9, seconds - row["loaded_s"]), 1)
    return out


def decoded_rates(trace: list, started: float, loaded_s: float | None, tokens_per_page: int | None) -> dict:
    """What the engine decoded, from its own trace (`scripts.bench.timeline`: wall clock, steps, tokens, rows about
    once a second; chunks still in flight counted): tokens a second after the model was loaded, and (with the
    stand-in's tokens a page) pages-equivalent an hour; tokens a second over the window after the first wave
    (``steady_*``: from the point where the first chunk admitted could have ended, i.e. after a third of the trace
    past load); the rows over time."""
    if not trace:
        return {}
    after = [p for p in trace if p[0] >= started + (loaded_s or 0.0)]
    out: dict = {"decoded_tokens": trace[-1][2],
                 "rows_over_time": [[round(p[0] - started, 1), p[3]] for p in trace[:: max(1, len(trace) // 40)]]}
    if len(after) >= 2:
        seconds = after[-1][0] - after[0][0]  # from the trace's first point after load
        out["decoded_tok_s_after_load"] = round((after[-1][2] - after[0][2]) / seconds, 1) if seconds > 0 else None
        third = after[len(after) // 3]
        steady = after[-1][0] - third[0]
        if steady > 0:
            out["steady_tok_s"] = round((after[-1][2] - third[2]) / steady, 1)
            out["steady_window_s"] = [round(third[0] - started, 1), round(after[-1][0] - started, 1)]
        out["mean_rows_after_load"] = round(sum(p[3] for p in after) / len(after), 1)
        if tokens_per_page and out.get("decoded_tok_s_after_load"):
            out["decoded_pages_per_hour_after_load"] = round(3600 * out["decoded_tok_s_after_load"] / tokens_per_page)
    return out


def environment(device: str) -> dict:
    """Versions and the GPU, without touching CUDA in this process (the run's own process owns the GPU)."""
    import platform

    import torch
    import transformers

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "python": platform.python_version(), "cpus": os.cpu_count()}
    if device != "cpu" and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
        env["gpu"] = out[0] if out else None
    return env


def page_counts_of(documents: list[Path]) -> list[int]:
    import pymupdf

    counts = []
    for d in documents:
        with pymupdf.open(d) as doc:
            counts.append(doc.page_count)
    return counts


def run_until(cmd: list[str], env: dict, max_seconds: float | None) -> tuple[subprocess.CompletedProcess, float | None]:
    """Run ``cmd``; past ``max_seconds`` stop it as an operator would (SIGTERM, and again to stop at once): the pages
    stored by then are the run's. Returns the finished process and the second it was cut at (None: not cut)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=max_seconds)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), None
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), max_seconds


def add_document_options(ap: argparse.ArgumentParser, docs: int, seed0: int) -> None:
    """The model and the synthetic documents' options (`write_documents`), shared with `scripts.bench.workers`."""
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--docs", type=int, default=docs)
    ap.add_argument("--doc-pages", default="4", help="pages a document: N, or A-B (drawn per document)")
    ap.add_argument("--seed0", type=int, default=seed0)
    ap.add_argument("--scan", action="store_true", help="image-only pages (no text layer)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_document_options(ap, docs=50, seed0=860_000)
    ap.add_argument("--ladder", action="store_true", help="the grades' difficulty ladder instead (ingest.synth.ladder: "
                    "1-4 pages, 9-20 pt, scans; most of it the demo model reads badly); --doc-pages is ignored")
    ap.add_argument("--max-batch", default="1,auto")
    ap.add_argument("--docs-at-batch-1", type=int, default=None,
                    help="fewer documents for max_batch 1 (its pages/hour is a rate; it is slow)")
    ap.add_argument("--mode", default="lossless", help="engine mode, or several (e.g. plain,lossless): each setting "
                    "runs once per mode")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk-pages", default="4", help="pages a chunk, or several (e.g. 1,4,8,16): each setting "
                    "runs once per chunk size (the chunk-size table)")
    ap.add_argument("--tokens-per-page", type=int, default=None, help="tokens a page for pages-equivalent an hour "
                    "(default: the stand-in's, standin.json)")
    ap.add_argument("--equivalent-tokens", type=int, default=1000, help="also say pages-equivalent an hour at this "
                    "many tokens a page (the conversion of a run with shorter pages)")
    ap.add_argument("--steady", action="store_true", help="uflash watch, the inbox kept fed with distinct copies of "
                    "the documents (scripts.bench.steady) until --max-seconds; rates over a window after the first wave")
    ap.add_argument("--steady-backlog", type=int, default=4000, help="pages kept waiting in steady mode")
    ap.add_argument("--vision-attention", choices=("auto", "model", "sdpa", "flex"), default="auto",
                    help="[engine] vision_attention")
    ap.add_argument("--vision-ahead", choices=("auto", "on", "off"), default="auto", help="[engine] vision_ahead")
    ap.add_argument("--max-tokens-per-page", type=int, default=1500)
    ap.add_argument("--docs-dir", type=Path, help="where the documents are made (those already there are reused)")
    ap.add_argument("--only-docs", action="store_true", help="make the documents (in --docs-dir) and stop")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop each run after this long (SIGTERM twice); "
                    "its rates are those of the pages stored by then")
    ap.add_argument("--repair", choices=("auto", "on", "off"), default="auto", help="[quality] repair (pages read "
                    "again alone); auto: off for a stand-in model (scripts.standin: its text fits no page's print)")
    ap.add_argument("--formats", default="", help="[outputs] formats (default: the config's own)")
    ap.add_argument("--prepare-processes", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="[worker] prepare_processes: page-preparation processes (0: the worker's own thread)")
    ap.add_argument("--logs", type=Path, help="folder for each setting's logs (uflash run's stderr and its file log)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    standin = (Path(args.model) / "standin.json").is_file()
    if args.tokens_per_page is None and standin:
        args.tokens_per_page = json.loads((Path(args.model) / "standin.json").read_text()).get("tokens_per_page")
    if args.steady and args.max_seconds is None:
        raise SystemExit("--steady needs --max-seconds (the inbox is fed until then)")
    args.repair = args.repair == "on" or (args.repair == "auto" and not standin)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    documents = write_documents(args.docs_dir or work / "docs", args.docs, args.doc_pages, args.seed0, args.scan,
                                args.ladder)
    if args.only_docs:
        print(json.dumps({"documents": len(documents), "pages": sum(page_counts_of(documents))}))
        return 0
    report = {"benchmark": "bench_pipeline", "argv": sys.argv[1:] if argv is None else argv, "settings": [],
              "model": json.loads((Path(args.model) / "standin.json").read_text()) if standin else {"path": args.model},
              "documents": len(documents), "pages": sum(page_counts_of(documents)), "repair": args.repair,
              "prepare_processes": args.prepare_processes,
              "environment": environment(args.device)}
    report["model"].pop("first_tokens", None)
    for mode in args.mode.split(","):
        for max_batch in args.max_batch.split(","):
            for chunk_pages in [int(c) for c in str(args.chunk_pages).split(",")]:
                docs = documents[: args.docs_at_batch_1] if max_batch == "1" and args.docs_at_batch_1 else documents
                report["settings"].append(one_setting(args, docs, max_batch, mode, work, chunk_pages))
                print_timeline(report["settings"][-1])
                write_json(args.json, report)  # what is measured so far survives a cut-off call
    print_table(report["settings"], args.tokens_per_page)
    for mode in args.mode.split(","):
        for key, name in (("pages_per_hour", "auto_over_1"), ("after_load_pages_per_hour", "after_load_auto_over_1")):
            rates = {r["max_batch"]: r.get(key) for r in report["settings"] if r["mode"] == mode}
            if rates.get("1") and rates.get("auto"):
                report.setdefault(name, {})[mode] = round(rates["auto"] / rates["1"], 2)
                print(f"{mode}: {key.replace('_', ' ')} at auto / at 1: {report[name][mode]}")
    for key, name in (("pages_per_hour", "lossless_over_plain"),
                      ("after_load_pages_per_hour", "after_load_lossless_over_plain"),
                      ("decoded_tok_s_after_load", "decoded_lossless_over_plain")):
        by = {(r["mode"], r["max_batch"]): r.get(key) for r in report["settings"]}
        for max_batch in args.max_batch.split(","):
            if by.get(("plain", max_batch)) and by.get(("lossless", max_batch)):
                report.setdefault(name, {})[max_batch] = round(by[("lossless", max_batch)] / by[("plain", max_batch)], 3)
        if name in report:
            print(f"{key.replace('_', ' ')} lossless / plain: {report[name]}")
    write_json(args.json, report)
    print(json.dumps(report, separators=(",", ":")))
    ok = all(r["exit_code"] == ExitCode.OK or r.get("cut_at_s") for r in report["settings"])
    return ExitCode.OK if ok else ExitCode.UNEXPECTED


def print_table(settings: list[dict], tokens_per_page: int | None) -> None:
    """One line a setting: the rows the engine ran, milliseconds a step, tokens decoded a second after load (chunks in
    flight counted), pages-equivalent an hour at ``tokens_per_page``, stored pages an hour (only over several waves; the
    steady window's in steady mode), the first stored page, the GPU's busy share and peak memory, the decode loop's
    thread outside engine steps."""
    print(f"\n{'mode':<9}{'batch':>6}{'chunk p':>8}{'rows':>6}{'ms/step':>8}{'tok/s':>9}"
          f"{f'p-eq/h @{tokens_per_page}':>14}{'stored p/h':>11}{'1st page s':>11}{'GPU busy':>9}{'peak GiB':>9}"
          f"{'loop %':>7}")
    for r in settings:
        stored = r.get("steady_stored_pages_per_hour") or r.get("after_load_pages_per_hour")
        outside = (r.get("main_outside_steps") or {}).get("outside_steps_share")
        print(f"{r['mode']:<9}{r['max_batch']:>6}{r['chunk_pages']:>8}{r.get('engine_rows') or 0:>6}"
              f"{r.get('ms_per_step') or 0:>8.1f}{r.get('decoded_tok_s_after_load') or 0:>9.0f}"
              f"{r.get('decoded_pages_per_hour_after_load') or 0:>14,}{(f'{stored:,.0f}' if stored else '-'):>11}"
              f"{r.get('first_page_s') or 0:>11.1f}{(r.get('gpu_busy') or {}).get('after_load') or 0:>9.2f}"
              f"{r.get('cuda_peak_gib') or 0:>9.1f}{100 * (outside or 0):>6.1f}%"
              + (f"  (cut at {r['cut_at_s']:.0f} s, {r['pages']} of {r['pages_queued']} pages stored)"
                 if r.get("cut_at_s") else ""))
        if r.get("stored_rate_omitted") and not r.get("steady"):
            print(f"{'':9}stored pages/h omitted: {r['stored_rate_omitted']}")


def write_json(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))

if __name__ == "__main__":
    sys.exit(main())
