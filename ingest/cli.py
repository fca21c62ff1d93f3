"""The ``uflash`` command. Typed errors become exit codes here, and only here.

Exit codes: 0 ok, 1 unexpected error, 2 bad configuration or usage, 3 model not available,
4 input rejected (``uflash run`` on a file that cannot be processed), 5 the ledger or the machine failed (database
unreachable or locked, disk full: ingest.errors.infrastructure_problem), 130 interrupted, 141 output pipe closed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

from loguru import logger

from ingest.config import Settings, load_settings
from ingest.errors import ConfigError, InfrastructureError, UflashError, UsageError, infrastructure_problem
from ingest.logs import setup_logging

MODES = ["official", "plain", "lossless", "fast"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uflash", description="Watch-folder batch OCR with Unlimited-OCR.")
    p.add_argument("--config", metavar="PATH", help="config file (default: ./config.toml or $UFLASH_CONFIG)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on the console")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only on the console")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    w = sub.add_parser("watch", help="watch the inbox and process what arrives (runs until stopped)")
    w.add_argument("--intake-only", action="store_true", help="record files but do not run the GPU worker")

    r = sub.add_parser("run", help="process these files (or the inbox) now, and exit when they are done")
    r.add_argument("paths", nargs="*", metavar="PATH",
                   help="files or folders: only their documents are decoded (default: everything in the inbox and "
                        "every document already queued in the ledger)")
    r.add_argument("--mode", choices=MODES,
                   help="official: transformers generate(); plain: our engine, one token a step; lossless: "
                        "speculative, token-identical to official; fast: speculative with relaxed acceptance "
                        "(engine.fast_threshold), not token-exact (default: engine.mode in the config)")
    r.add_argument("--out", metavar="DIR", help="write outputs here instead of folders.outbox")

    rp = sub.add_parser("report", help="per-page grades, reasons, tau and tokens/s of a run; writes the HTML report")
    rp.add_argument("--run", type=int, metavar="ID",
                    help="the run: one per `uflash run`, `uflash watch` process or `uflash rerun` (default: the "
                         "latest run with pages)")
    rp.add_argument("--grade", choices=["good", "fair", "poor"], help="only pages of this grade")
    rp.add_argument("--json", action="store_true", help="print one JSON object")
    rp.add_argument("--no-html", action="store_true", help="do not write <outbox>/reports/run-<ID>.html")

    rr = sub.add_parser("rerun", help="decode pages again into a new run (history kept) and rewrite the outputs")
    rr.add_argument("--mode", choices=MODES, default="lossless", help="decode mode of the re-run (default lossless)")
    rr.add_argument("--grade", choices=["good", "fair", "poor"], help="pages whose latest grade is this")
    rr.add_argument("--doc", type=int, metavar="ID", help="pages of this document")
    rr.add_argument("--pages", metavar="A-B", help="pages in this range (e.g. 3-7)")

    d = sub.add_parser("diff", help="per-page normalized edit distance between the texts of two runs")
    d.add_argument("run_a", type=int, metavar="RUN_A")
    d.add_argument("run_b", type=int, metavar="RUN_B")
    d.add_argument("--json", action="store_true", help="print one JSON object")

    t = sub.add_parser("windows-task", help="write the Windows Task Scheduler XML that starts `uflash watch` at boot "
                                            "(import: schtasks /Create /TN uflash /XML FILE)")
    t.add_argument("--out", metavar="FILE", default="uflash-task.xml", help="where to write it")
    t.add_argument("--user", help="run as this account (default: SYSTEM; a named one needs its password at import)")

    s = sub.add_parser("status", help="documents and chunks by state, failures and their reasons")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--limit", type=int, default=20, help="how many failures to list")

    c = sub.add_parser("check", help="check the set-up of this machine: the ledger (reachable, schema version), "
                                     "the folders and the model; changes nothing")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _open_db(settings: Settings):  # noqa: ANN202
    """The ledger, created or migrated to this uflash's schema. A URL that cannot work is a configuration error; an
    unreachable server raises what the database layer raised (an infrastructure problem, exit code 5)."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from db.session import Database, SchemaTooNew
    from ingest.check import masked_url

    try:
        return Database(settings.database_url, settings.database.busy_timeout_ms)
    except SchemaTooNew as e:
        raise UsageError(str(e)) from None
    except ImportError as e:
        raise ConfigError(f"database.url {masked_url(settings.database_url)} needs a database driver that is not "
                          f"installed ({e.name}): pip install -e \".[postgres]\"") from None
    except (ArgumentError, NoSuchModuleError) as e:
        raise ConfigError(f"database.url {masked_url(settings.database_url)} is not a usable database URL: {e}") \
            from None


def _open_db_waiting(settings: Settings, stop: threading.Event):  # noqa: ANN202
    """``_open_db`` for the long-running watcher: while the ledger cannot be reached (its server not up yet after a
    power cut, the network down), say so loudly and try again with a growing backoff. None when stopped first."""
    from ingest.check import masked_url
    from ingest.health import Trouble

    trouble = Trouble(settings.logs, "start")
    while not stop.is_set():
        try:
            db = _open_db(settings)
            trouble.ok()
            return db
        except Exception as e:
            problem = infrastructure_problem(e)
            if problem is None:
                raise
            stop.wait(trouble.failed(f"cannot open the ledger {masked_url(settings.database_url)}: {problem}"))
    return None


def _missing_ledger(settings: Settings) -> Path | None:
    """The SQLite ledger file the settings name, when it does not exist: the commands that only read it must not
    create an empty one (a status run from the wrong folder would report an empty ledger, and leave one behind)."""
    url, prefix = settings.database_url, "sqlite:///"
    if url.startswith(prefix) and ":memory:" not in url and not Path(url[len(prefix):]).exists():
        return Path(url[len(prefix):])
    return None


def _open_existing_db(settings: Settings):  # noqa: ANN202
    if (missing := _missing_ledger(settings)) is not None:
        raise UsageError(f"no ledger at {missing}: nothing has been taken in with this configuration "
                         "(--config or UFLASH_CONFIG names another)")
    return _open_db(settings)


def _stop_event() -> threading.Event:
    """An event set by SIGTERM/SIGINT (and SIGBREAK on Windows), so loops finish their file and exit. A second
    signal exits at once (130): the chunk in progress is not stored, and its lease lets the next worker redo it
    (the crash path, tested with SIGKILL), so nothing is lost by not waiting for a long decode."""
    stop = threading.Event()

    def handler(signum, _frame):  # noqa: ANN001
        if stop.is_set():
            logger.warning("signal {} again: stopping now; the chunk in progress is redone by the next worker", signum)
            logger.remove()  # closes (flushes) the log file before the hard exit
            os._exit(130)
        logger.info("signal {} received: finishing the current step, then stopping (again: stop now)", signum)
        stop.set()

    for name in ("SIGTERM", "SIGINT", "SIGBREAK"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), handler)
    return stop


def _make_worker(settings: Settings, db, **kw):  # noqa: ANN001, ANN202
    from engine.chunk_decode import load_decoder
    from ingest.worker import Worker

    m, e = settings.model, settings.engine
    return Worker(settings, db, lambda: load_decoder(settings.model_path, m.device, m.dtype, e.mode, e.fast_threshold,
                                                     max_pages_per_chunk=e.max_pages_per_chunk), **kw)


def cmd_watch(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.watch import InboxWatcher
    from ingest.worker import ModelUnavailable, wait_backoff

    settings.check_folders()
    settings.ensure_folders()
    stop = _stop_event()
    db = _open_db_waiting(settings, stop)
    if db is None:
        logger.info("stopped")
        return 0
    watcher = InboxWatcher(settings, db)
    if args.intake_only:
        watcher.run(stop)
        logger.info("stopped")
        return 0
    intake = threading.Thread(target=watcher.run, args=(stop,), name="intake", daemon=True)
    intake.start()
    # a run per batch: opened at its first chunk, closed with its HTML report once the queue runs dry (and when
    # the process stops), so a watcher that runs for weeks leaves one report per batch dropped into the inbox
    worker = _make_worker(settings, db)

    def batch_done() -> None:
        if (run_id := worker.close_run()) is not None:
            logger.info("queue empty: run {} closed", run_id)
            _write_report(settings, db, run_id, log=True)

    worker.on_idle = batch_done
    run_id = None
    try:
        while not stop.is_set():
            try:
                worker.serve(stop)
            except ModelUnavailable as e:
                logger.error("worker cannot start: {}; intake goes on, retrying in 60s", e)
                wait_backoff(60, stop)
    finally:
        stop.set()
        try:
            run_id = worker.close_run()
        except Exception as e:  # the ledger is down: the next worker on this host closes the run as crashed
            if infrastructure_problem(e) is None:
                raise
            logger.error("could not close run {}: {}; the next uflash on this machine closes it", worker._run_id,
                         infrastructure_problem(e))
        intake.join(timeout=30)
    logger.info("stopped{}", f" (run {run_id} closed)" if run_id is not None else "")
    return 0


def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.batch import run_batch

    if args.out:
        settings.folders.outbox = Path(args.out).expanduser().resolve()
    if args.mode:
        settings.engine.mode = args.mode
    settings.check_folders()
    settings.ensure_folders()
    db = _open_db(settings)
    res = run_batch(settings, db, [Path(p) for p in args.paths], _make_worker, _stop_event())
    if res.run_id is not None:  # the report of this invocation's run only (nothing decoded: no report)
        _write_report(settings, db, res.run_id)
    return res.code


def _write_report(settings: Settings, db, run_id: int | None = None, log: bool = False) -> None:  # noqa: ANN001
    from ingest.report import write_html_report

    try:
        path = write_html_report(db, settings.outbox, run_id, settings.config_file,
                                 settings.quality.unsure_word_prob)
    except Exception as e:  # the report is a by-product: never fail a finished run over it
        logger.warning("could not write the HTML report: {}", e)
        return
    if path and log:
        logger.info("report of run {}: {}", run_id, path)
    elif path:
        print(f"report  {path}")


def cmd_report(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.report import collect_report, format_report, report_json

    db = _open_existing_db(settings)
    rep = collect_report(db, args.run, args.grade)
    print(report_json(rep) if args.json else format_report(rep))
    if not args.no_html and rep["run"] is not None:
        settings.outbox.mkdir(parents=True, exist_ok=True)
        if args.json:
            from ingest.report import write_html_report

            write_html_report(db, settings.outbox, rep["run"]["id"], settings.config_file,
                              settings.quality.unsure_word_prob)
        else:
            _write_report(settings, db, rep["run"]["id"])
    return 0


def cmd_rerun(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.rerun import parse_pages, rerun

    settings.engine.mode = args.mode
    settings.check_folders()
    settings.ensure_folders()
    db = _open_db(settings)
    pages = parse_pages(args.pages) if args.pages else None
    res = rerun(settings, db, _make_worker, _stop_event(), grade=args.grade, doc_id=args.doc, pages=pages)
    if res.run_id is None and not res.chunks:
        print("nothing to re-run: no stored page matches")
        return 0
    print(f"re-run  {res.pages} pages in {len(res.chunks)} chunks -> run {res.run_id} ({args.mode}); "
          f"earlier run(s) {', '.join(map(str, res.earlier_runs))}")
    for f in res.failed:
        print(f"failed  {f}")
    for c in res.cancelled:
        print(f"not run {c}: stopped before it was decoded (`uflash rerun` again picks it)")
    if res.run_id is not None:
        _write_report(settings, db, res.run_id)
        for earlier in res.earlier_runs:
            print(f"compare uflash diff {earlier} {res.run_id}")
    return 4 if res.failed else 130 if res.cancelled else 0


def cmd_diff(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.rerun import diff_runs, format_diff

    d = diff_runs(_open_existing_db(settings), args.run_a, args.run_b)
    print(json.dumps(d) if args.json else format_diff(d))
    return 0


def cmd_windows_task(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.config import _find_config
    from ingest.windows_task import write_task_xml

    config = _find_config(args.config)
    if config is None:
        raise UsageError("windows-task needs a config file for the task to start with: --config PATH")
    out = write_task_xml(Path(args.out), config, user=args.user)
    print(f"wrote {out}: import it with   schtasks /Create /TN uflash /XML \"{out.absolute()}\"")
    return 0


def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.check import masked_url
    from ingest.health import format_trouble, read_trouble
    from ingest.status import collect_status, format_status

    from db.session import Database

    ledger = masked_url(settings.database_url)
    trouble = read_trouble(settings.logs)  # written by the watchers of this machine: readable with the ledger down
    missing = _missing_ledger(settings)
    if missing is not None:
        print(f"uflash: no ledger at {missing} yet: nothing taken in with this configuration", file=sys.stderr)
    try:
        st = collect_status(Database("sqlite://") if missing else _open_db(settings), limit=args.limit)
    except Exception as e:
        if (problem := infrastructure_problem(e)) is None:
            raise
        if args.json:
            print(json.dumps({"ledger": ledger, "error": problem, "infrastructure": trouble}))
        else:
            print("\n".join([f"ledger: {ledger}", f"the ledger cannot be read: {problem}", *format_trouble(trouble)]))
        return InfrastructureError.exit_code
    st["ledger"] = ledger
    st["infrastructure"] = trouble
    print(json.dumps(st) if args.json else f"ledger: {st['ledger']}\n" + format_status(st))
    return 0


def cmd_check(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.check import format_checks, run_checks

    result = run_checks(settings)
    print(json.dumps(result) if args.json else format_checks(result))
    return result["exit_code"]


COMMANDS = {"watch": cmd_watch, "run": cmd_run, "status": cmd_status, "report": cmd_report, "rerun": cmd_rerun,
            "diff": cmd_diff, "windows-task": cmd_windows_task, "check": cmd_check}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(None, args.verbose, args.quiet)
    try:
        settings = load_settings(args.config)
        if args.command not in ("status", "report", "diff", "windows-task", "check"):
            settings.ensure_folders("logs")
            setup_logging(settings.logs, args.verbose, args.quiet)
        code = COMMANDS[args.command](settings, args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at interpreter exit
        return code
    except BrokenPipeError:  # the reader went away (`uflash report | head -1`): stop quietly, as CLI tools do
        with contextlib.suppress(OSError, ValueError):  # so the flush at exit cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # killed by SIGPIPE, as a shell reports it
    except UflashError as e:
        kind = "config error" if isinstance(e, ConfigError) else "error"
        print(f"uflash: {kind}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("uflash: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if (problem := infrastructure_problem(e)) is not None:  # the ledger or the machine, not the input
            logger.opt(exception=True).debug("{}", problem)
            err = InfrastructureError(problem)
            print(f"uflash: error: {err}", file=sys.stderr)
            return err.exit_code
        logger.opt(exception=True).error("unexpected error: {}", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
