"""The run report and the review page: what a person reads after a run (report, page, assets), and what became of
each file, in the words every command uses (outcomes).

May import quality/, reading/, pages/, ledger/, the top modules (config, errors, files, logs), engine/ and db/."""
