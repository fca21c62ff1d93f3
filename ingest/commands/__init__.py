"""The ways in: the `uflash` command line (cli, parser), its subcommands (batch, rerun, retry, check, status), the
Windows scheduled task and the OCRmyPDF plugin. Exit codes are chosen here only (`ingest.errors.ExitCode`).

May import every other stage of ingest/, engine/ and db/; nothing imports it."""
