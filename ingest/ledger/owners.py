"""Who holds a lease or a run, and whether that process is known to be gone.

An owner is ``host:pid:started`` (``started``: the process's start time, whole UNIX seconds). Leases and runs
name their owner so that a later uflash process on the same host can tell at once that the owner died (killed,
crashed, the machine rebooted) instead of waiting for the lease to run out, and can close a run that was never
closed. The start time tells a dead owner from a new process that was given the same pid (pids are reused
quickly on Windows, and from 1 again after a reboot).

``is_gone`` answers True only when it is sure: the owner ran on this host and no process with its pid and start
time exists. An owner on another host (a shared PostgreSQL ledger), or one written without a start time by an
older uflash whose pid is alive, is not known to be gone: its leases end when they expire, as before.
Two containers that share a host name but not their process table would each take the other's workers for
gone; give containers their own host names (the default in Docker and Kubernetes).
"""

from __future__ import annotations

import os
import socket
from functools import cache

import psutil


@cache
def this_process() -> str:
    """This process as an owner: ``host:pid:started``."""
    return f"{socket.gethostname()}:{os.getpid()}:{int(psutil.Process().create_time())}"


def is_gone(owner: str | None) -> bool:
    """True when ``owner``'s process is known to have ended (see the module's docstring)."""
    host, _, rest = (owner or "").partition(":")
    pid_s, _, started_s = rest.partition(":")
    if host != socket.gethostname() or not pid_s.isdigit():
        return False
    pid = int(pid_s)
    if pid == os.getpid():
        return owner != this_process()
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # ended, not yet reaped by its parent
            return True
        started = proc.create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # e.g. access denied: it exists, and is not ours to judge
        return False
    return started_s.isdigit() and abs(started - int(started_s)) > 1.0
