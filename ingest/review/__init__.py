"""The run report and the review page: what a person reads after a run (report, page, assets), and what became of
each file, in the words every command uses (outcomes); the review server a person corrects pages on (server), the
corrections it stores (corrections), the re-runs it queues (rerun_queue), and corrected pages exported as training
pairs (export).

May import worker/ (the server writes a document's outputs again through its finisher), quality/, reading/, pages/,
ledger/, the top modules (config, errors, files, logs), engine/ and db/."""
