"""The ``uflash`` command. Typed errors become exit codes here, and only here (``EXIT_CODES``; the codes are
ingest.errors.ExitCode): 0 ok, 1 unexpected error, 2 bad configuration or usage, 3 model not available, 4 input
rejected (``uflash run`` on a file that cannot be processed), 5 the ledger or the machine failed (database unreachable
or locked, disk full: ingest.errors.infrastructure_problem), 130 interrupted, 141 output pipe closed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from db.session import masked_url
from ingest.commands.parser import build_parser
from ingest.config import Settings, load_settings
from ingest.errors import (
    ConfigError,
    ExitCode,
    InfrastructureError,
    InputRejected,
    ModelUnavailable,
    UflashError,
    UsageError,
    infrastructure_problem,
)
from ingest.ledger.open import missing_ledger, open_existing_ledger, open_ledger, open_ledger_waiting
from ingest.logs import setup_logging
from ingest.worker.model_files import locate_model

EXIT_CODES: dict[type[UflashError], ExitCode] = {ConfigError: ExitCode.CONFIG, UsageError: ExitCode.CONFIG,
                                                 ModelUnavailable: ExitCode.MODEL, InputRejected: ExitCode.INPUT,
                                                 InfrastructureError: ExitCode.INFRASTRUCTURE}


def exit_code(e: UflashError | type[UflashError]) -> ExitCode:
    """The exit code of an error (or of an error class)."""
    cls = e if isinstance(e, type) else type(e)
    return next((code for kind, code in EXIT_CODES.items() if issubclass(cls, kind)), ExitCode.UNEXPECTED)


def _report(settings: Settings, db, log: bool = False) -> Callable[[int], None]:  # noqa: ANN001
    """Writes a run's HTML report and says where (printed, or logged by the long-running watcher)."""

    def report(run_id: int) -> None:
        from ingest.quality.calibration import grading_thresholds
        from ingest.review.report import write_html_report

        try:
            path = write_html_report(db, settings.outbox, run_id, settings.config_file,
                                     grading_thresholds(settings).thresholds.unsure_word_prob)
        except Exception as e:  # the report is a by-product: never fail a finished run over it
            logger.warning("could not write the HTML report: {}", e)
            return
        if path and log:
            logger.info("report of run {}: {}", run_id, path)
        elif path:
            print(f"report  {path}")

    return report


def cmd_watch(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.intake.watch import InboxWatcher
    from ingest.worker.lifecycle import serve_batches, stop_event
    from ingest.worker.worker import make_worker

    settings.check_folders()
    settings.ensure_folders()
    stop = stop_event()
    db = open_ledger_waiting(settings, stop)
    if db is None:
        logger.info("stopped")
        return ExitCode.OK
    if args.intake_only:  # no runs: refused files and duplicates are recorded without one
        InboxWatcher(settings, db).run(stop)
        logger.info("stopped")
        return ExitCode.OK
    with make_worker(settings, db) as worker:  # the model is loaded when the first chunk is claimed
        watcher = InboxWatcher(settings, db, intake_run=worker.run)  # its files are named in the batch's report
        intake = threading.Thread(target=watcher.run, args=(stop,), name="intake", daemon=True)
        intake.start()
        try:
            run_id = serve_batches(worker, stop, _report(settings, db, log=True))
        finally:
            stop.set()
            intake.join(timeout=30)
    logger.info("stopped{}", f" (run {run_id} closed)" if run_id is not None else "")
    return ExitCode.OK


def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.commands.batch import run_batch
    from ingest.worker.lifecycle import stop_event
    from ingest.worker.worker import make_worker

    if args.out:
        settings.folders.outbox = Path(args.out).expanduser().resolve()
    if args.mode:
        settings.engine.mode = args.mode
    settings.check_folders()
    settings.ensure_folders()
    db = open_ledger(settings)
    stop = stop_event()
    res = run_batch(settings, db, [Path(p) for p in args.paths], make_worker, stop, _report(settings, db))
    if res.failed or res.refused:
        return ExitCode.INPUT
    return ExitCode.INTERRUPTED if res.pending or res.interrupted else ExitCode.OK


def cmd_report(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.review.report import collect_report, format_report, report_json

    db = open_existing_ledger(settings)
    rep = collect_report(db, args.run, args.grade)
    print(report_json(rep) if args.json else format_report(rep))
    if not args.no_html and rep["run"] is not None:
        settings.outbox.mkdir(parents=True, exist_ok=True)
        if args.json:
            from ingest.quality.calibration import grading_thresholds
            from ingest.review.report import write_html_report

            write_html_report(db, settings.outbox, rep["run"]["id"], settings.config_file,
                              grading_thresholds(settings).thresholds.unsure_word_prob)
        else:
            _report(settings, db)(rep["run"]["id"])
    return ExitCode.OK


def cmd_rerun(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.commands.rerun import parse_pages, rerun
    from ingest.worker.lifecycle import stop_event
    from ingest.worker.worker import make_worker

    settings.engine.mode = args.mode
    settings.check_folders()
    settings.ensure_folders()
    db = open_ledger(settings)
    pages = parse_pages(args.pages) if args.pages else None
    res = rerun(settings, db, make_worker, stop_event(), _report(settings, db), grade=args.grade, doc_id=args.doc,
                pages=pages, announce=lambda r: print("\n".join(_rerun_lines(r, args.mode))))
    if res.run_id is None and not res.chunks:
        print("nothing to re-run: no stored page matches")
        return ExitCode.OK
    for earlier in res.earlier_runs:
        print(f"compare uflash diff {earlier} {res.run_id}")
    return ExitCode.INPUT if res.failed else ExitCode.INTERRUPTED if res.cancelled else ExitCode.OK


def _rerun_lines(res, mode: str) -> list[str]:  # noqa: ANN001
    return [f"re-run  {res.pages} pages in {len(res.chunks)} chunks -> run {res.run_id} ({mode}); "
            f"earlier run(s) {', '.join(map(str, res.earlier_runs))}",
            *(f"failed  {f}" for f in res.failed),
            *(f"not run {c}: stopped before it was decoded (`uflash rerun` again picks it)" for c in res.cancelled)]


def cmd_diff(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.commands.rerun import diff_corrections, diff_runs, format_diff, format_diff_corrections

    if args.corrections:
        if args.run_a is not None:
            raise UsageError("diff --corrections compares the model's readings with the corrections: no runs")
        d = diff_corrections(open_existing_ledger(settings))
        print(json.dumps(d) if args.json else format_diff_corrections(d))
        return ExitCode.OK
    if args.run_a is None or args.run_b is None:
        raise UsageError("diff: two runs (RUN_A RUN_B), or --corrections")
    d = diff_runs(open_existing_ledger(settings), args.run_a, args.run_b)
    print(json.dumps(d) if args.json else format_diff(d))
    return ExitCode.OK


def cmd_review(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.review.server import serve

    serve(settings, open_existing_ledger(settings), args.host, args.port, args.run,
          announce=lambda line: print(line, flush=True))
    return ExitCode.OK


def cmd_export_corrections(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.review.export import MANIFEST, export_corrections

    out = Path(args.out).expanduser().resolve()
    lines = export_corrections(open_existing_ledger(settings), out)
    print(f"exported {len(lines)} corrected pages -> {out / MANIFEST}")
    return ExitCode.OK


def cmd_windows_task(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.commands.windows_task import write_task_xml
    from ingest.config import _find_config

    config = _find_config(args.config)
    if config is None:
        raise UsageError("windows-task needs a config file for the task to start with: --config PATH")
    out = write_task_xml(Path(args.out), config, user=args.user)
    print(f"wrote {out}: import it with   schtasks /Create /TN uflash /XML \"{out.absolute()}\"")
    return ExitCode.OK


def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    from db.session import Database
    from ingest.commands.status import collect_status, format_status
    from ingest.ledger.health import format_trouble, read_trouble
    from ingest.quality.calibration import grading_thresholds

    ledger = masked_url(settings.database_url)
    trouble = read_trouble(settings.logs)  # written by the watchers of this machine: readable with the ledger down
    missing = missing_ledger(settings)
    if missing is not None:
        print(f"uflash: no ledger at {missing} yet: nothing taken in with this configuration", file=sys.stderr)
    try:
        st = collect_status(Database("sqlite://") if missing else open_ledger(settings), limit=args.limit)
    except Exception as e:
        if (problem := infrastructure_problem(e)) is None:
            raise
        if args.json:
            print(json.dumps({"ledger": ledger, "error": problem, "infrastructure": trouble}))
        else:
            print("\n".join([f"ledger: {ledger}", f"the ledger cannot be read: {problem}", *format_trouble(trouble)]))
        return ExitCode.INFRASTRUCTURE
    st["ledger"] = ledger
    st["infrastructure"] = trouble
    grading = grading_thresholds(settings)
    st["grades"] = {"calibrated": grading.calibrated, "model": grading.model, "summary": grading.summary()}
    print(json.dumps(st) if args.json else f"ledger: {st['ledger']}\n" + format_status(st))
    return ExitCode.OK


def cmd_retry(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.commands.retry import retry, what_to_retry

    settings.ensure_folders()
    db = open_existing_ledger(settings)
    todo = what_to_retry(settings, db, args.doc, args.file, args.all)  # all checked before any is touched
    if not todo.documents and not todo.refused:
        print("nothing to retry: no document is failed and no refused file waits in failed/")
        return ExitCode.OK
    print("\n".join(retry(settings, db, todo)))
    print("`uflash watch` takes them (a running one takes them now), or `uflash run`")
    return ExitCode.OK


def cmd_check(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.commands.check import format_checks, run_checks

    result = run_checks(settings)
    failed = [c for c in result["checks"] if not c["ok"]]
    result["exit_code"] = exit_code(failed[0].pop("fault")) if failed else ExitCode.OK
    for c in result["checks"]:
        c.pop("fault", None)
    print(json.dumps(result) if args.json else format_checks(result))
    return result["exit_code"]


def cmd_calibrate(settings: Settings, args: argparse.Namespace) -> int:
    from ingest.calibration.calibrate import calibrate, format_calibration

    if args.from_corrections:
        from ingest.calibration.corrections import calibrate_from_corrections

        record, path = calibrate_from_corrections(settings, open_existing_ledger(settings))
        print(format_calibration(record, path))
        return ExitCode.OK
    budget_pages, budget_s = parse_budget(args.budget)
    if args.max_batch:
        settings.engine.max_batch = args.max_batch
    elif settings.engine.max_batch == "auto" and not settings.model.device.startswith("cuda"):
        import torch

        if settings.model.device == "cpu" or not torch.cuda.is_available():
            settings.engine.max_batch = 16  # one row a step costs nearly as much as sixteen on a CPU
    record, path = calibrate(settings, args.docs, budget_pages, budget_s, Path(args.work) if args.work else None)
    print(format_calibration(record, path))
    return ExitCode.OK


def parse_budget(text: str | None) -> tuple[int, float]:
    """``--budget``: (pages, seconds), one of them 0: "200" pages, "600s" seconds."""
    if not text:
        return 0, 0.0
    try:
        if text.endswith("s"):
            return 0, float(text[:-1])
        return int(text.removesuffix("p")), 0.0
    except ValueError:
        raise UsageError(f"--budget {text!r}: pages (200) or seconds (600s)") from None


DECODING = ("run", "rerun")  # commands that need the model's files before they take anything in (`uflash watch` waits
# for a missing model: its intake goes on)
COMMANDS = {"watch": cmd_watch, "run": cmd_run, "status": cmd_status, "report": cmd_report, "rerun": cmd_rerun,
            "diff": cmd_diff, "windows-task": cmd_windows_task, "check": cmd_check, "calibrate": cmd_calibrate,
            "retry": cmd_retry, "review": cmd_review, "export-corrections": cmd_export_corrections}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(None, args.verbose, args.quiet)
    try:
        settings = load_settings(args.config)
        if getattr(args, "device", None):
            settings = settings.on_device(args.device)
        if args.command in DECODING:  # a decode that cannot start leaves nothing behind (no folders, no ledger)
            locate_model(settings)
        if args.command not in ("status", "report", "diff", "windows-task", "check"):
            settings.ensure_folders("logs")
            setup_logging(settings.logs, args.verbose, args.quiet)
            logger.info("{}", settings.source())
        code = COMMANDS[args.command](settings, args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at interpreter exit
        return int(code)
    except BrokenPipeError:  # the reader went away (`uflash report | head -1`): stop quietly, as CLI tools do
        with contextlib.suppress(OSError, ValueError):  # so the flush at exit cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.PIPE_CLOSED  # killed by SIGPIPE, as a shell reports it
    except UflashError as e:
        kind = "config error" if isinstance(e, ConfigError) else "error"
        print(f"uflash: {kind}: {e}", file=sys.stderr)
        return exit_code(e)
    except KeyboardInterrupt:
        print("uflash: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except Exception as e:
        if (problem := infrastructure_problem(e)) is not None:  # the ledger or the machine, not the input
            logger.opt(exception=True).debug("{}", problem)
            print(f"uflash: error: {InfrastructureError(problem)}", file=sys.stderr)
            return ExitCode.INFRASTRUCTURE
        logger.opt(exception=True).error("unexpected error: {}", e)
        return ExitCode.UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
