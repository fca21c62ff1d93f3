"""The ``uflash`` command line: its commands and their options (ingest.commands.cli runs them)."""

from __future__ import annotations

import argparse

MODES = ["official", "plain", "lossless", "fast"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uflash", description="Watch-folder batch OCR with Unlimited-OCR.")
    p.add_argument("--config", metavar="PATH", help="config file (default: ./config.toml or $UFLASH_CONFIG)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on the console")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only on the console")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dev = ("the device this process decodes on: cpu, cuda or cuda:N (default: model.device in the config); one "
           "worker per GPU on one ledger: start one `uflash watch --device cuda:N` per GPU")

    w = sub.add_parser("watch", help="watch the inbox and process what arrives (runs until stopped)")
    w.add_argument("--intake-only", action="store_true", help="record files but do not run the GPU worker")
    w.add_argument("--device", help=dev)

    r = sub.add_parser("run", help="process these files (or the inbox) now, and exit when they are done")
    r.add_argument("paths", nargs="*", metavar="PATH",
                   help="files or folders: only their documents are decoded (default: everything in the inbox and "
                        "every document already queued in the ledger)")
    r.add_argument("--mode", choices=MODES,
                   help="official: transformers generate(); plain: our engine, one token a step; lossless: "
                        "speculative, token-identical to official; fast: speculative with relaxed acceptance "
                        "(engine.fast_threshold), not token-exact (default: engine.mode in the config)")
    r.add_argument("--out", metavar="DIR", help="write outputs here instead of folders.outbox")
    r.add_argument("--device", help=dev)

    rp = sub.add_parser("report", help="per-page grades, reasons, tau and tokens/s of a run; writes the HTML report")
    rp.add_argument("--run", type=int, metavar="ID",
                    help="the run: one per `uflash run`, `uflash watch` batch or `uflash rerun` (default: the "
                         "latest run that decoded pages or took files in)")
    rp.add_argument("--grade", choices=["good", "fair", "poor"], help="only pages of this grade")
    rp.add_argument("--json", action="store_true", help="print one JSON object")
    rp.add_argument("--no-html", action="store_true", help="do not write <outbox>/reports/run-<ID>.html")

    rr = sub.add_parser("rerun", help="decode pages again into a new run (history kept) and rewrite the outputs")
    rr.add_argument("--mode", choices=MODES, default="lossless", help="decode mode of the re-run (default lossless)")
    rr.add_argument("--grade", choices=["good", "fair", "poor"], help="pages whose latest grade is this")
    rr.add_argument("--doc", type=int, metavar="ID", help="pages of this document")
    rr.add_argument("--pages", metavar="A-B", help="pages in this range (e.g. 3-7)")
    rr.add_argument("--device", help=dev)

    d = sub.add_parser("diff", help="per-page normalized edit distance between the texts of two runs, or the CER of "
                                    "the model's reading against each page a person corrected",
                       description="For each page that both runs decoded: the normalized edit distance between its "
                                   "two texts (0 = identical), then the mean, the max and the identical pages. A run's "
                                   "id: the first line of `uflash report`, or the `uflash diff` line that `uflash "
                                   "rerun` prints. --corrections: per page corrected on the review page (`uflash "
                                   "review`), the model's reading against the correction: its CER and the words "
                                   "changed.")
    d.add_argument("run_a", type=int, nargs="?", metavar="RUN_A",
                   help="the earlier run's id (e.g. the first `uflash run`)")
    d.add_argument("run_b", type=int, nargs="?", metavar="RUN_B",
                   help="the later run's id (e.g. the `uflash rerun` of its pages)")
    d.add_argument("--corrections", action="store_true",
                   help="compare the model's readings with the corrections people made instead of two runs")
    d.add_argument("--json", action="store_true", help="print one JSON object")

    rv = sub.add_parser("review", help="serve the review page on this machine: correct pages, undo, mark them "
                                       "checked, queue re-runs (until Ctrl+C)")
    rv.add_argument("--run", type=int, metavar="ID", help="the run whose pages it shows first (default: the latest "
                                                          "run that decoded pages or took files in)")
    rv.add_argument("--host", default="127.0.0.1",
                    help="the address to listen on (default 127.0.0.1: this machine only); another address lets "
                         "other machines reach it, with the token it prints")
    rv.add_argument("--port", type=int, default=0, help="the port (default: a free one)")

    ex = sub.add_parser("export-corrections", help="write the pages people corrected as training pairs (page image, "
                                                   "text) for the drafter recipe")
    ex.add_argument("--out", metavar="DIR", required=True, help="the folder to write them into")

    t = sub.add_parser("windows-task", help="write the Windows Task Scheduler XML that starts `uflash watch` at boot "
                                            "(import: schtasks /Create /TN uflash /XML FILE)")
    t.add_argument("--out", metavar="FILE", default="uflash-task.xml", help="where to write it")
    t.add_argument("--user", help="run as this account (default: SYSTEM; a named one needs its password at import)")

    rt = sub.add_parser("retry", help="queue failed documents again (their originals back out of the failed folder, "
                                      "their failed chunks with their attempts reset) and put refused files back "
                                      "into the inbox, to be taken in again")
    which = rt.add_mutually_exclusive_group(required=True)
    which.add_argument("--doc", type=int, metavar="ID", action="append",
                       help="this failed document (`uflash status` lists them with their ids); may be repeated")
    which.add_argument("--file", metavar="PATH", action="append",
                       help="this file in the failed folder: a refused file (back into the inbox; refused again only "
                            "if it still cannot be processed) or a failed document's original; may be repeated")
    which.add_argument("--all", action="store_true", help="every failed document and every refused file in the "
                                                          "failed folder")

    s = sub.add_parser("status", help="documents and chunks by state, failures and their reasons, and where each "
                                      "original is")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--limit", type=int, default=20,
                   help="how many of each list to show (waiting, done, failed, refused files, duplicates)")

    cal = sub.add_parser("calibrate", help="choose the page grades' thresholds for the configured model on a labelled "
                                           "ladder (or on the pages people corrected: --from-corrections) and write "
                                           "them beside it (calibration.json); resumable")
    cal.add_argument("--docs", type=int, metavar="N",
                     help="ladder documents of 1-4 pages, half of them held out (default: 360 on a GPU, 40 on a CPU)")
    cal.add_argument("--budget", metavar="N|Ns",
                     help="stop after N pages (200) or N seconds (600s), keep what is read and fit on it; a next run "
                          "goes on where this one stopped")
    cal.add_argument("--max-batch", type=int, metavar="N",
                     help="chunks decoding together (default: engine.max_batch; 16 on a CPU when that is auto)")
    cal.add_argument("--work", metavar="DIR", help="where the ladder's readings are cached (default: "
                                                   "var/calibration/<model identity> beside the config)")
    cal.add_argument("--device", help=dev)
    cal.add_argument("--from-corrections", action="store_true",
                     help="fit the thresholds on the pages people corrected (`uflash review`) instead of the ladder: "
                          "each correction is the truth of its page; nothing is decoded")

    c = sub.add_parser("check", help="check the set-up of this machine: the ledger (reachable, schema version), "
                                     "the folders and the model; changes nothing")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    return p
