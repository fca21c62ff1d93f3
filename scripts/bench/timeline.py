"""``uflash`` with a timeline: where the wall time of one command goes, written as JSON when the process ends.

    python -m scripts.bench.timeline OUT.json -- --config config.toml run docs/*.pdf

Runs ``ingest.commands.cli`` in this process after wrapping the functions that do each kind of work with timers
(nothing in ``engine/`` or ``ingest/`` changes; a function that is not there any more is listed under ``missing``;
the JSON is rewritten every 5 s too, and when a second SIGTERM stops the process at once):
imports (ingest's CLI, torch, transformers), intake of the named files, model load (``engine.loading.load_decoder``: weights, engine, buffers),
graph capture (``StepGraphs.capture``), the tokens the engines decoded (``engine.decoded``, chunks in flight
included) and their trace (``engine_trace``: wall clock, steps, tokens, rows, about once a second), page preparation (``ingest.pages.prefetch``'s ``prepare`` in its thread, or
its ``locate`` there and the page-preparation processes' own time, ``PreparePool.timing``, with the copy of what they
hand back, ``ingest.pages.pool``'s ``unpack``), orientation probes (``ingest.worker.probes``: starting a chunk's
probes, and each probe's end; the probes' decoding is in the engine steps), submission (the processor on the caller's
thread, unless the processes built the inputs), engine steps (``engine_step``: its admissions, i.e. vision and
prefill, and its decode steps, split by the engine's own ``timing``), quality checks, ledger claims and stores, and
finishing documents (grades, outputs, moves: a thread of its own). Each is summed separately for the main thread
(where it holds up the decode loop), for other threads (where it overlaps it) and, for page preparation, for other
processes, with its call count and the main-thread seconds it ran inside another probe (``nested_main_s``: graph
captures inside load or engine steps, engine steps inside quality repairs).
``main_other_s``: the main thread's wall that no probe covers (the loop's own work, waiting).
`print_timeline` prints it as a table; `GpuSampler` gives the GPU's busy share over the same run.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

T0 = time.perf_counter()
PROBES = {  # name: (module, attribute path), or several whose times add up
    "intake": ("ingest.commands.batch", "intake_file"),
    "load": ("engine.loading", "load_decoder"),
    "graph_capture": ("engine.kernels.step_graphs", "StepGraphs.capture"),
    "page_preparation": [("ingest.pages.prefetch", "prepare"), ("ingest.pages.prefetch", "locate"),
                         ("ingest.pages.prefetch", "prepare_pages")],
    "prepared_copy": ("ingest.pages.pool", "unpack"),
    "orientation": [("ingest.worker.probes", "Turns.start"), ("ingest.worker.probes", "Turns.ended")],
    "submit": ("engine.chunk_decode", "EngineDecoder.submit"),
    "engine_steps": ("engine.chunk_decode", "EngineDecoder.engine_step"),
    "quality_checks": ("ingest.worker.checks", "checked_stats"),
    "ledger_claim": ("ingest.worker.worker", "claim"),
    "ledger_release": ("ingest.worker.worker", "release"),
    "ledger_store": ("ingest.worker.worker", "store_chunk"),
    "finishing": ("ingest.worker.finish", "Finisher.finish"),
    "finish_ready": ("ingest.worker.finish", "Finisher.finish_ready"),
}
_totals: dict[str, dict[str, float]] = {}
_depth = threading.local()  # probes running on this thread (a probe inside another is counted as nested)
_engines: list = []
_pools: list = []  # page-preparation pools: their processes' own time
_lock = threading.Lock()
_turns = {"turns": 0, "turns_s": 0.0, "steps_s": 0.0, "first": None, "last": None}  # the loop's decoding turns


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t, nested = time.perf_counter(), getattr(_depth, "n", 0) > 0
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n -= 1
            where = "main" if threading.current_thread() is threading.main_thread() else "other"
            seconds = time.perf_counter() - t
            with _lock:
                row = _totals.setdefault(name, {"main_s": 0.0, "other_s": 0.0, "nested_main_s": 0.0, "calls": 0})
                row[f"{where}_s"] += seconds
                row["nested_main_s"] += seconds if nested and where == "main" else 0.0
                row["calls"] += 1
    return wrapper


def _decoding_turns(fn):
    """``Worker._step`` timed when the worker has chunks decoding as it starts (no wait of the loop's is in such a turn):
    its wall, and the engine steps' main-thread seconds within it; the rest is the decode loop's thread held up by
    other work (claims, submissions, stores, and any per-page work left on it)."""
    @functools.wraps(fn)
    def turn(self, *args, **kwargs):
        if not self.inflight or threading.current_thread() is not threading.main_thread():
            return fn(self, *args, **kwargs)
        steps0, t = _totals.get("engine_steps", {}).get("main_s", 0.0), time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            end = time.perf_counter()
            with _lock:
                _turns["turns"] += 1
                _turns["turns_s"] += end - t
                _turns["steps_s"] += _totals.get("engine_steps", {}).get("main_s", 0.0) - steps0
                _turns["first"] = t if _turns["first"] is None else _turns["first"]
                _turns["last"] = end
    return turn


def main_outside_steps(turns: dict) -> dict:
    """The decode loop's thread outside engine steps while chunks decode: seconds, and share of the span from the
    first such turn to the last (the wall while the engine had rows)."""
    outside = max(0.0, turns["turns_s"] - turns["steps_s"])
    span = (turns["last"] - turns["first"]) if turns["first"] is not None else 0.0
    return {"turns": turns["turns"], "decoding_span_s": round(span, 3), "engine_steps_s": round(turns["steps_s"], 3),
            "outside_steps_s": round(outside, 3), "outside_steps_share": round(outside / span, 4) if span else None}


def install() -> list[str]:
    """Wrap every probe; the names of those not found."""
    missing = []
    try:
        from ingest.worker.worker import Worker

        Worker._step = _decoding_turns(Worker._step)
    except (ImportError, AttributeError):
        missing.append("decoding_turns (ingest.worker.worker.Worker._step)")
    for name, targets in PROBES.items():
        for module, path in targets if isinstance(targets, list) else [targets]:
            try:
                owner = importlib.import_module(module)
                *parents, attr = path.split(".")
                for p in parents:
                    owner = getattr(owner, p)
                setattr(owner, attr, _timed(name, getattr(owner, attr)))
            except (ImportError, AttributeError):
                missing.append(f"{name} ({module}.{path})")
    for module, cls, kept, name in (("engine.batch.engine", "BatchEngine", _engines, "engine_timing"),
                                    ("ingest.pages.pool", "PreparePool", _pools, "pool_timing")):
        try:  # the engines and pools made, to read their own timing at the end
            _keep_instances(getattr(importlib.import_module(module), cls), kept)
        except (ImportError, AttributeError):
            missing.append(name)
    return missing


def _keep_instances(cls, kept: list) -> None:
    init = cls.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        kept.append(self)

    cls.__init__ = keep


def _cuda_peak_gib() -> float | None:
    """The most memory torch held allocated on this process's GPU (None: no CUDA used)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def report(imports_s: float, missing: list[str]) -> dict:
    wall = time.perf_counter() - T0
    engine = {"vision_s": 0.0, "vision_ahead_s": 0.0, "prefill_s": 0.0, "steps_s": 0.0, "steps": 0, "decoded": 0,
              "rows": 0}
    trace = []  # (wall clock, steps, tokens decoded, rows) about once a second, of every engine made
    for e in _engines:
        for key in ("vision_s", "vision_ahead_s", "prefill_s", "steps_s"):
            engine[key] += float(getattr(e, "timing", {}).get(key, 0.0))
        engine["steps"] += int(getattr(e, "steps", 0))
        engine["decoded"] += int(getattr(e, "decoded", 0))
        engine["rows"] = max(engine["rows"], int(getattr(e, "max_batch", 0)))  # the rows it was sized for
        trace += [list(point) for point in getattr(e, "trace", [])]
    pools = {"processes": 0, "jobs": 0, "pages": 0, "prepare_s": 0.0, "receive_s": 0.0, "restarts": 0}
    for p in _pools:
        pools["processes"] += p.processes
        for key in ("jobs", "pages", "prepare_s", "receive_s", "restarts"):
            pools[key] += p.timing.get(key, 0)
    covered = sum(v["main_s"] - v["nested_main_s"] for v in _totals.values())  # each second once
    return {"wall_s": round(wall, 3), "imports_s": round(imports_s, 3),
            "probes": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in _totals.items()},
            "engine": {k: round(v, 3) for k, v in engine.items()}, "engine_trace": trace,
            "preparation_processes": {k: round(v, 3) for k, v in pools.items()},
            "main_other_s": round(wall - imports_s - covered, 3), "main_outside_steps": main_outside_steps(_turns),
            "cuda_peak_gib": _cuda_peak_gib(),
            "missing": missing}


# -- read by scripts.bench.pipeline (the parent process) --------------------------------------------------
def timeline_rows(t: dict) -> list[tuple[str, float, float, float]]:
    """(what, main-thread seconds, other threads' seconds, other processes' seconds) of a run's timeline, in the order
    work happens."""
    probes, engine = t.get("probes", {}), t.get("engine", {})
    steps = probes.get("engine_steps", {})
    capture = probes.get("graph_capture", {})
    pools = t.get("preparation_processes", {})
    inside = sum(engine.get(k, 0.0) for k in ("vision_s", "vision_ahead_s", "prefill_s", "steps_s"))

    def probe(name: str, key: str, processes: float = 0.0) -> tuple[str, float, float, float]:
        return name, probes.get(key, {}).get("main_s", 0.0), probes.get(key, {}).get("other_s", 0.0), processes

    rows = [("start-up (interpreter)", t.get("startup_s", 0.0), 0.0, 0.0),
            ("imports", t.get("imports_s", 0.0), 0.0, 0.0),
            ("intake (hash, plan)", probes.get("intake", {}).get("main_s", 0.0), 0.0, 0.0),
            probe("model load", "load"), probe("page preparation", "page_preparation", pools.get("prepare_s", 0.0)),
            probe("prepared pages copied", "prepared_copy"), probe("orientation probes", "orientation"),
            probe("submit (processor)", "submit"),
            ("graph capture", capture.get("main_s", 0.0), capture.get("other_s", 0.0), 0.0),
            ("vision", engine.get("vision_s", 0.0), 0.0, 0.0),
            ("vision ahead (launch)", engine.get("vision_ahead_s", 0.0), 0.0, 0.0),
            ("prefill", engine.get("prefill_s", 0.0), 0.0, 0.0),
            ("decode steps", engine.get("steps_s", 0.0), 0.0, 0.0),
            ("engine host work", max(0.0, steps.get("main_s", 0.0) - inside), 0.0, 0.0),
            probe("quality checks", "quality_checks"), probe("finishing documents", "finishing"),
            probe("ledger claims", "ledger_claim"), probe("ledger stores", "ledger_store"),
            ("main loop, other", t.get("main_other_s", 0.0), 0.0, 0.0)]
    return rows


def print_timeline(row: dict) -> None:
    t = row.get("timeline")
    if not t:
        return
    wall = row["seconds"]
    gpu = row.get("gpu_busy") or {}
    print(f"\n{row['mode']} max_batch {row['max_batch']}: {wall:.1f} s wall; GPU busy {gpu.get('whole_run')} of the "
          f"run, {gpu.get('after_load')} after load (nvidia-smi)")
    print(f"{'where':<24}{'main s':>9}{'% wall':>8}{'other threads s':>17}{'processes s':>13}")
    for name, main, other, processes in timeline_rows(t):
        print(f"{name:<24}{main:>9.2f}{100 * main / wall:>7.1f}%{other:>17.2f}{processes:>13.2f}")
    pools = t.get("preparation_processes") or {}
    if pools.get("processes"):
        print(f"({pools['processes']} page-preparation processes: {pools['pages']} pages in {pools['jobs']} chunks, "
              f"{pools['restarts']} restarts)")
    print("(graph capture runs inside model load or engine steps; vision, prefill, decode steps and engine host work "
          "make up the engine steps, repairs' and probes' included)")
    if (m := t.get("main_outside_steps") or {}).get("outside_steps_share") is not None:
        print(f"decode loop's thread outside engine steps while chunks decode: {m['outside_steps_s']:.2f} s, "
              f"{100 * m['outside_steps_share']:.2f}% of the {m['decoding_span_s']:.1f} s they decoded in")


class GpuSampler:
    """The GPU's busy share while a run goes (``nvidia-smi`` utilization.gpu: the share of each sample period in
    which a kernel ran, sampled every 200 ms); nothing without a GPU."""

    def __init__(self, device: str):
        self.samples: list[tuple[float, float]] = []
        self.proc = None
        self.wanted = device != "cpu" and shutil.which("nvidia-smi") is not None
        index = device.split(":")[1] if device.startswith("cuda:") else "0"
        self.cmd = ["nvidia-smi", "-i", index, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                    "-lms", "200"]

    def __enter__(self) -> GpuSampler:
        if self.wanted:
            self.t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter() - self.t0, float(line.strip())))
            except ValueError:
                pass

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def busy(self, after_s: float | None) -> dict | None:
        if not self.samples:
            return None
        late = [u for t, u in self.samples if after_s is None or t >= after_s]
        return {"whole_run": round(statistics.mean(u for _, u in self.samples) / 100, 3),
                "after_load": round(statistics.mean(late) / 100, 3) if late else None, "samples": len(self.samples)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__.split("\n\n")[0] + "\n\nusage: python -m scripts.bench.timeline OUT.json -- UFLASH_ARGS...")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    out, args = Path(argv[0]), argv[2:]
    import torch  # noqa: F401 - imports counted as imports, as uflash would make them anyway
    import transformers  # noqa: F401

    from ingest.commands import cli

    imports_s = time.perf_counter() - T0
    missing = install()
    def write() -> None:
        out.write_text(json.dumps(report(imports_s, missing), indent=1))

    def every(seconds: float) -> None:  # a run stopped at once (os._exit) keeps the timeline of a moment before
        while True:
            time.sleep(seconds)
            write()

    atexit.register(write)
    exit_now = os._exit  # a second SIGTERM stops the process at once (ingest.worker.lifecycle): written first

    def written_then_exit(code: int) -> None:
        if threading.current_thread() is threading.main_thread():
            write()
        exit_now(code)

    os._exit = written_then_exit
    threading.Thread(target=every, args=(5.0,), daemon=True).start()
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
