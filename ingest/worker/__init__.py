"""Claiming, decoding, storing, finishing: the worker loop (worker), one run lifecycle (lifecycle), the chunks in
flight (inflight), what a finished or failed chunk does to the ledger (outcome) and a finished document (finish).

May import outputs/, quality/, reading/, intake/, pages/, ledger/, the top modules, engine/ and db/."""
