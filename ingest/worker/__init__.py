"""Claiming, decoding, storing, finishing: the worker loop (worker), one run lifecycle (lifecycle), the chunks in
flight (inflight), the orientation probes decoded beside them (probes), what a finished or failed chunk does to the
ledger (outcome), a finished document (finish) and the thread that finishes documents (finish_queue).

May import outputs/, quality/, reading/, intake/, pages/, ledger/, the top modules, engine/ and db/."""
