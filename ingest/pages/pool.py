"""Page preparation in processes of its own: rendering, measuring and the processor run on other cores, outside the
worker's GIL, while the worker's thread keeps the GPU busy (ingest.pages.prefetch hands them its chunks).

``PreparePool(n, model_path)`` starts ``n`` processes the first time it is given a job, with the "spawn" start
method (nothing of the worker is copied into them; they never touch CUDA). Each (ingest.pages.prepare_process) loads
the model's processor (not the model) and runs ``ingest.pages.prepare.prepare_pages`` on the jobs it is sent, one at a
time, handing each result back through shared memory (ingest.pages.shm). A thread of the worker sends the jobs and
collects the results; it calls each job's ``done`` with a ``PagesReady``, an ``Unrenderable`` (the file's fault, word
for word as in the worker's own thread), or an exception: ``InfrastructureError`` (the machine's trouble),
``PreparationDied``, ``PoolBroken``, or uflash's own error as the process raised it.

A process that dies (killed, out of memory, a crash inside a PDF library) is started again and its job prepared once
more; a job whose process dies twice ends ``PreparationDied`` (its chunk fails with that reason and is tried again
after a backoff, ingest.worker.outcome). A job still running after ``JOB_SECONDS`` counts as a death. When the
processes cannot start at all (``START_FAILURES`` in a row die before they are ready) the pool is ``broken`` and every
job comes back ``PoolBroken``: the worker prepares its chunks in its own thread.

``close()`` asks each process to leave, waits ``timeout`` seconds in all, then terminates and kills what is left: it
never waits for ever, and neither does the interpreter's exit (the processes are daemons and leave on SIGTERM). They
ignore SIGINT, which a terminal's Ctrl+C sends to every process of its group, so that the worker stops them in order;
a process whose worker is gone (killed outright) leaves as soon as its pipe closes.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from loguru import logger

from ingest.config import Settings
from ingest.pages.prepare import PageJob
from ingest.pages.prepare_process import error_from, serve
from ingest.pages.shm import discard, unmap_unused, unpack, via_pipe

JOB_SECONDS = 600.0  # a chunk's pages take a second or two: ten minutes means a process stuck in a bad file
START_FAILURES = 3  # processes in a row that die before they are ready: the pool is broken
MAX_PROCESSES = 8  # "auto": one fewer than the cores, at most this many


class PreparationDied(Exception):
    """The process preparing a job died twice on it (or ran past ``JOB_SECONDS``)."""


class PoolBroken(Exception):
    """The pool's processes cannot start: the job was not prepared (the caller prepares it itself)."""


def process_count(setting: int | str) -> int:
    """``worker.prepare_processes`` as a number: "auto" is one fewer than the cores this process may use, at most
    ``MAX_PROCESSES`` (0 on one core)."""
    if setting != "auto":
        return int(setting)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(cores - 1, MAX_PROCESSES))


def preparation_pool(settings: Settings) -> PreparePool | None:
    """The pool ``worker.prepare_processes`` asks for (None for 0: the worker prepares pages in its own thread). Its
    processes build the model's inputs too, unless the mode is ``official`` (transformers' ``generate()`` takes the
    pages' images, not inputs)."""
    processes = process_count(settings.worker.prepare_processes)
    return PreparePool(processes, settings.model_path, settings.engine.mode != "official") if processes else None


@dataclass
class _Job:
    id: int
    job: PageJob
    done: Callable[[Any], None]
    tries: int = 0
    started: float = 0.0


@dataclass
class _Process:
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection
    ready: bool = False
    job: _Job | None = None


class PreparePool:
    """``processes`` page-preparation processes (see the module docstring); ``inputs``: build the model's inputs with
    the processor of the model at ``model_path``."""

    def __init__(self, processes: int, model_path: str | None = None, inputs: bool = True):
        if processes < 1:
            raise ValueError("a preparation pool needs at least one process")
        self.processes, self.model_path, self.inputs = processes, model_path, inputs
        self.broken: str | None = None
        self.timing = {"jobs": 0, "pages": 0, "prepare_s": 0.0, "prepare_cpu_s": 0.0, "pack_cpu_s": 0.0,
                       "receive_s": 0.0, "receive_cpu_s": 0.0, "restarts": 0}  # wall, and the thread's processor time
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[int, _Job] = {}  # submitted and neither delivered nor cancelled
        self._ids = itertools.count(1)
        self._procs: list[_Process] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        self._wake_r: Connection | None = None
        self._wake_w: Connection | None = None
        self._woken = False
        self._failed_starts = 0
        self._said: set[str] = set()

    # -- the worker's side ------------------------------------------------------------------------
    def submit(self, job: PageJob, done: Callable[[Any], None]) -> int:
        """Queue ``job``; ``done(result)`` is called on the pool's thread once it is prepared (not after ``cancel``).
        Returns the job's id."""
        with self._lock:
            if self._closing:
                raise RuntimeError("the page preparation pool is closing")
            j = _Job(next(self._ids), job, done)
            if self.broken is not None:
                j.done(PoolBroken(self.broken))
                return j.id
            self._jobs[j.id] = j
            self._queue.append(j)
            if self._thread is None:
                logger.info("page preparation: {} process{}", self.processes, "es" if self.processes > 1 else "")
                self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
                self._thread = threading.Thread(target=self._run, name="prepare-pool", daemon=True)
                self._thread.start()
        self._wake()
        return j.id

    def cancel(self, ids: list[int]) -> list[int]:
        """Forget these jobs: their ``done`` is not called after this returns. Returns those not yet done."""
        with self._lock:
            gone = [i for i in ids if self._jobs.pop(i, None) is not None]
            self._queue = deque(j for j in self._queue if j.id in self._jobs)
        return gone

    def pids(self) -> dict[int, bool]:
        """The processes running now: pid -> whether it is preparing a job."""
        return {p.process.pid: p.job is not None for p in list(self._procs)}

    def close(self, timeout: float = 10.0) -> None:
        """Stop the processes (see the module docstring); jobs not done are dropped. A later ``submit`` starts
        again."""
        with self._lock:
            thread, self._closing = self._thread, True
            self._queue.clear()
            self._jobs.clear()
        if thread is not None:
            self._wake()
            thread.join(timeout)
        deadline = time.monotonic() + timeout
        for p in self._procs:
            try:
                p.conn.send(None)
            except OSError:
                pass
        for p in self._procs:
            self._stop(p, deadline)
        if self._procs:
            logger.debug("page preparation: {} processes stopped", len(self._procs))
        for c in (self._wake_r, self._wake_w):
            if c is not None:
                c.close()
        with self._lock:
            self._procs, self._thread, self._wake_r, self._wake_w = [], None, None, None
            self._closing, self._woken = False, False

    def __enter__(self) -> PreparePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pool's thread ------------------------------------------------------------------------
    def _wake(self) -> None:
        with self._lock:
            if self._woken or self._wake_w is None:
                return
            self._woken = True
            try:
                self._wake_w.send_bytes(b"w")
            except OSError:
                pass

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closing:
                    return
            try:
                self._keep_processes()
                self._dispatch()
                procs = list(self._procs)
                ready = wait([self._wake_r] + [p.conn for p in procs] + [p.process.sentinel for p in procs], 1.0)
                if self._wake_r in ready:
                    with self._lock:
                        while self._wake_r.poll():
                            self._wake_r.recv_bytes()
                        self._woken = False
                for p in procs:
                    if p.conn in ready or p.process.sentinel in ready:
                        self._receive(p)
                self._overdue()
                unmap_unused()  # the memory of chunks decoded since
            except Exception as e:  # noqa: BLE001 - the thread must not die silently: its jobs would never end
                logger.opt(exception=e).error("page preparation: {}: {}", type(e).__name__, e)
                self._break(f"{type(e).__name__}: {e}")
                return

    def _keep_processes(self) -> None:
        while len(self._procs) < self.processes and self.broken is None and not self._closing:
            parent, child = self._ctx.Pipe()
            process = self._ctx.Process(target=serve, args=(child, self.model_path, self.inputs),
                                        name="uflash-prepare", daemon=True)
            try:
                process.start()
            except Exception as e:  # noqa: BLE001 - no process can start here: the worker prepares its own pages
                parent.close()
                self._break(f"cannot start a process: {type(e).__name__}: {e}")
                return
            finally:
                child.close()
            self._procs.append(_Process(process, parent))
            logger.debug("page preparation: process {} started", process.pid)

    def _dispatch(self) -> None:
        for p in list(self._procs):
            if not p.ready or p.job is not None:
                continue
            with self._lock:
                job = self._queue.popleft() if self._queue else None
            if job is None:
                return
            p.job, job.started = job, time.monotonic()
            try:
                p.conn.send(("job", job.id, job.job))
            except OSError:
                self._died(p)

    def _receive(self, p: _Process) -> None:
        try:
            while p.conn.poll():
                self._message(p, p.conn.recv())
        except (EOFError, OSError):
            self._died(p)
            return
        if not p.process.is_alive():
            self._died(p)

    def _message(self, p: _Process, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            _, pid, has_processor, why = msg
            p.ready, self._failed_starts = True, 0
            if why:
                self._say_once("processor", "page preparation: the processes cannot load the model's processor "
                               f"({why}); the model's inputs are built on the worker's thread")
            return
        _, job_id, body, *pack_cpu_s = msg
        p.job = None
        self._dispatch()  # the process goes on with the next job while this one is taken in
        with self._lock:
            wanted = job_id in self._jobs
        if kind == "done" and not wanted:
            discard(body)
            result: Any = None
        elif kind == "done":
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                result = unpack(body)
            except Exception as e:  # noqa: BLE001 - handed to the worker as the chunk's error
                result = e
            self.timing["receive_s"] += time.perf_counter() - t0
            self.timing["receive_cpu_s"] += time.thread_time() - cpu0
            if via_pipe(body):
                self._say_once("pipe", "page preparation: too little shared memory (/dev/shm): prepared pages come "
                               "through a pipe, more slowly; give the container more (docker run --shm-size 2g)")
            self.timing["prepare_s"] += getattr(result, "seconds", 0.0)
            self.timing["prepare_cpu_s"] += getattr(result, "cpu_seconds", 0.0)
            self.timing["pack_cpu_s"] += sum(pack_cpu_s)
            self.timing["pages"] += len(getattr(result, "pages", ()))
            self.timing["jobs"] += 1
        else:
            result = error_from(body)
        if kind == "done" and body.block is not None:
            try:
                p.conn.send(("release", body.block))  # mapped here: the process may let it go
            except OSError:
                pass
        if wanted:
            self._deliver(job_id, result)

    def _deliver(self, job_id: int, result: Any) -> None:
        with self._lock:  # under the lock: once ``cancel`` returns, no ``done`` of its jobs runs any more
            job = self._jobs.pop(job_id, None)
            if job is not None:
                job.done(result)

    def _died(self, p: _Process) -> None:
        if p not in self._procs:
            return
        self._procs.remove(p)
        p.process.join(1.0)
        code = p.process.exitcode
        p.conn.close()
        if self._closing:
            return
        how = f"killed by {_signal_name(-code)}" if code is not None and code < 0 else f"exit code {code}"
        self.timing["restarts"] += 1
        if not p.ready:
            self._failed_starts += 1
            logger.warning("page preparation: process {} died before it was ready ({})", p.process.pid, how)
            if self._failed_starts >= START_FAILURES:
                self._break(f"{START_FAILURES} processes in a row died before they were ready (the last: {how})")
            return
        job = p.job
        with self._lock:
            wanted = job is not None and job.id in self._jobs
        if not wanted:
            logger.warning("page preparation: process {} died ({}); started again", p.process.pid, how)
            return
        job.tries += 1
        if job.tries >= 2:
            logger.warning("page preparation: process {} died ({}) preparing {} pages {}-{}, for the second time",
                           p.process.pid, how, job.job.path, job.job.first, job.job.last)
            self._deliver(job.id, PreparationDied(f"the page preparation process died ({how}) twice while preparing "
                                                  f"these pages"))
            return
        logger.warning("page preparation: process {} died ({}) preparing {} pages {}-{}; they are prepared again",
                       p.process.pid, how, job.job.path, job.job.first, job.job.last)
        with self._lock:
            self._queue.appendleft(job)

    def _overdue(self) -> None:
        now = time.monotonic()
        for p in list(self._procs):
            if p.job is not None and now - p.job.started > JOB_SECONDS:
                logger.warning("page preparation: process {} has prepared {} pages {}-{} for {:.0f} s: stopped",
                               p.process.pid, p.job.job.path, p.job.job.first, p.job.job.last, now - p.job.started)
                p.process.kill()
                p.process.join(5.0)
                self._died(p)

    def _break(self, why: str) -> None:
        """No process can prepare pages here: every job comes back ``PoolBroken`` (the worker prepares them)."""
        logger.error("page preparation processes unusable ({}); pages are prepared in the worker's thread", why)
        with self._lock:
            self.broken = why
            jobs = list(self._jobs.values())
            self._queue.clear()
        for j in jobs:
            self._deliver(j.id, PoolBroken(why))

    def _stop(self, p: _Process, deadline: float) -> None:
        """Wait for a process asked to leave (its results not taken are removed), then terminate or kill it."""
        while p.process.is_alive() and time.monotonic() < deadline:
            try:
                if p.conn.poll(0.05):
                    msg = p.conn.recv()
                    if msg[0] == "done":
                        discard(msg[2])
            except (EOFError, OSError):
                p.process.join(max(0.0, deadline - time.monotonic()))
        for end in (p.process.terminate, p.process.kill):
            if not p.process.is_alive():
                break
            end()
            p.process.join(2.0)
        p.conn.close()

    def _say_once(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(text)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
