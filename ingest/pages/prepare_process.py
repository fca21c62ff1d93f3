"""A page-preparation process of ``ingest.pages.pool.PreparePool``: started with the "spawn" start method, it loads
the model's processor (not the model, never a GPU), prepares each job its pool sends (``ingest.pages.prepare``) and
hands the pages back through shared memory (``ingest.pages.shm``), or the error it met as ``describe_error`` writes
it (``error_from`` raises it again on the pool's side), until told to leave or its worker is gone.

The messages on its pipe: to the pool ``("ready", pid, has_processor, why_not)`` once, then per job
``("done", job_id, packed, pack_cpu_s)`` or ``("error", job_id, described)``; from the pool ``("job", job_id, job)``,
``("release", block)`` (the pool has mapped that block) and ``None`` (leave).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from multiprocessing.connection import Connection

from ingest.errors import InfrastructureError, infrastructure_problem
from ingest.pages.prepare import prepare_pages
from ingest.pages.shm import Outbox


def serve(conn: Connection, model_path: str | None, inputs: bool) -> None:
    """A preparation process: prepare each job sent, until told to leave (None) or its worker is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the worker's to act on
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # never a GPU here, whatever a library asks for
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        os.nice(5)  # the worker's thread feeds the GPU: it goes first
    except (AttributeError, OSError):
        pass
    import torch

    torch.set_num_threads(1)  # one core each: there are as many processes as cores to spare
    processor, why = None, None
    if inputs and model_path:
        from engine.model.load import load_processor

        try:
            processor = load_processor(model_path)
        except Exception as e:  # noqa: BLE001 - pages are still rendered; the worker builds the inputs
            why = f"{type(e).__name__}: {e}"
    try:
        conn.send(("ready", os.getpid(), processor is not None, why))
    except OSError:
        _leave()
    outbox = Outbox()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the worker is gone
                return
            if msg is None:
                return
            if msg[0] == "release":  # the worker has mapped that block
                outbox.release(msg[1])
                continue
            _, job_id, job = msg
            try:
                ready = prepare_pages(job, processor)
                cpu0 = time.thread_time()
                packed = outbox.pack(ready)
                reply = ("done", job_id, packed, time.thread_time() - cpu0)
            except Exception as e:  # noqa: BLE001 - handed to the worker, which decides what it means
                reply = ("error", job_id, describe_error(e))
            try:
                conn.send(reply)
            except OSError:
                return
    finally:
        outbox.release()
        conn.close()
        _leave()


def _leave() -> None:
    """Leave now: a process that has loaded torch takes seconds to tear its modules down, and holds nothing that
    needs it (its blocks are released, its pipe closed)."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def describe_error(e: BaseException) -> tuple:
    """``e`` as it travels to the pool: the machine's trouble as its one line, else the pickled exception, else its
    type and text."""
    if (problem := infrastructure_problem(e)) is not None:
        return "infrastructure", problem
    try:
        data = pickle.dumps(e)
        pickle.loads(data)
        return "exception", data
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its type and text
        return "text", f"{type(e).__name__}: {e}"


def error_from(described: tuple) -> BaseException:
    """The exception a preparation process met (``describe_error``), as the pool's process raises it."""
    kind, detail = described
    if kind == "infrastructure":
        return InfrastructureError(detail)
    if kind == "exception":
        try:
            return pickle.loads(detail)
        except Exception:  # noqa: BLE001
            pass
    return RuntimeError(f"page preparation failed: {detail if kind == 'text' else 'an exception'}")
