"""Claiming, decoding, storing, finishing: the worker loop (worker), one run lifecycle (lifecycle), the chunks in
flight (inflight), the orientation probes decoded beside them (probes), what a finished or failed chunk does to the
ledger (outcome), a finished document (finish), the thread that finishes documents (finish_queue), and the model's
files found or said missing (model_files).

May import outputs/, quality/, reading/, intake/, pages/, ledger/, the top modules, engine/ and db/."""
