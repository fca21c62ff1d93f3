"""The checks' thread (ingest.worker.checks) alone, with a scripted check: chunks come back in order once stored, a
repair waits for the loop to decode it, an error comes back to the loop, and leaving gives back what was not stored
(a check that waits for a repair ends at once)."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import ingest.worker.checks as checks_module
from ingest.worker.checks import SWITCH_INTERVAL, ChunkChecks, WorkerStopped


def chunk(n: int):
    return SimpleNamespace(claim=f"claim-{n}", label=f"chunk {n}")


def test_checked_chunks_are_stored_on_the_thread_and_repairs_decoded_by_the_loop(monkeypatch):
    stored, threads = [], set()

    def check(settings, c, out, tokenizer, decode_alone):
        threads.add(threading.current_thread().name)
        if out == "repair me":
            return [{"alone": decode_alone(["image"], ["ref"], None)}]
        if out == "bad":
            raise ValueError("a bug in a check")
        return [{"out": out}]

    monkeypatch.setattr(checks_module, "checked_stats", check)
    interval = sys.getswitchinterval()
    with ChunkChecks(None, lambda c, out, stats: stored.append((c.label, stats))) as checks:
        assert sys.getswitchinterval() == min(interval, SWITCH_INTERVAL)  # the loop's thread gets the lock back soon
        checks.put(chunk(1), "fine", None)
        checks.put(chunk(2), "repair me", None)
        checks.put(chunk(3), "bad", None)
        asked = []
        while not asked:  # the loop's turn: submit what the checks asked for
            checks.wait(1.0)
            asked = checks.repairs()
        (repair,) = asked
        assert (repair.images, repair.references) == (["image"], ["ref"]) and checks.busy
        checks.resolve(repair, "the page read alone")
        done: list = []
        while len(done) < 3:
            checks.wait(1.0)
            done += checks.take()
    assert [c.label for c, _, _ in done] == ["chunk 1", "chunk 2", "chunk 3"] and threads == {"checks"}
    assert [e for *_, e in done][:2] == [None, None] and isinstance(done[2][2], ValueError)
    assert stored == [("chunk 1", [{"out": "fine"}]), ("chunk 2", [{"alone": "the page read alone"}])]
    assert not checks.busy and checks.left() == [] and sys.getswitchinterval() == interval


def test_leaving_gives_back_the_chunks_not_stored_and_ends_a_check_that_waits_for_a_repair(monkeypatch):
    monkeypatch.setattr(checks_module, "checked_stats",
                        lambda settings, c, out, tokenizer, decode_alone: decode_alone([], [], None))
    checks = ChunkChecks(None, lambda *a: None)
    with checks:
        checks.put(chunk(1), "repair me", None)
        while not checks.repairs():
            checks.wait(1.0)
    (c, _, error), = checks._done  # the repair the loop never decoded ended the check, and it was not stored
    assert c.label == "chunk 1" and isinstance(error, WorkerStopped)
    assert checks.left() == ["claim-1"] and not checks.busy
