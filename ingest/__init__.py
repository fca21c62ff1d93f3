"""uflash ingest side: configuration, watch-folder intake, worker, outputs and the CLI."""
