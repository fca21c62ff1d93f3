"""`uflash check`: the set-up of a machine (ledger, folders, model) checked without changing anything."""

from __future__ import annotations

import json

from db.models import SchemaVersion
from db.session import SCHEMA_VERSION, Database
from ingest.config import load_settings
from tests.conftest import uflash, worker_config, write_config


def _check(cfg, *args):
    r = uflash("--config", str(cfg), "check", *args)
    return r.returncode, r.stdout + r.stderr


def _line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(name + " "))


def test_check_on_a_new_and_on_a_working_ledger(tmp_path, tiny_model_dir, ledger_url):
    """Before the first start: the ledger is empty (or not there yet), the folders not there yet; nothing is created.
    After it: the schema version is this uflash's. An older ledger is to be migrated, a newer one refused."""
    cfg = worker_config(tmp_path, tiny_model_dir, database={"url": ledger_url})
    code, out = _check(cfg)
    assert code == 0, out
    ledger = _line(out, "ledger")
    assert ("no ledger yet" if ledger_url.startswith("sqlite") else "empty: the first") in ledger, out
    assert "not there yet; created at the first start" in _line(out, "inbox")
    assert _line(out, "model").split()[1] == "ok" and out.rstrip().endswith("all good")
    # a model without calibration: said plainly, with how to calibrate it (not a failure)
    grades = _line(out, "grades")
    assert grades.split()[1] == "ok" and "NOT calibrated" in grades and "uflash calibrate" in grades, out
    settings = load_settings(cfg)
    assert not settings.inbox.exists() and not (tmp_path / "uflash.db").exists()  # it changed nothing
    db = Database(settings.database_url)
    settings.ensure_folders()
    code, out = _check(cfg)
    assert code == 0 and f"schema version {SCHEMA_VERSION}, this uflash's" in _line(out, "ledger"), out
    assert "writable" in _line(out, "outbox") and "free" in _line(out, "outbox")
    for version, code_wanted, said in ((SCHEMA_VERSION - 1, 0, f"migrates it to {SCHEMA_VERSION}"),
                                       (SCHEMA_VERSION + 1, 2, "newer than this uflash's")):
        with db.engine.begin() as conn:
            conn.execute(SchemaVersion.__table__.delete())
            conn.execute(SchemaVersion.__table__.insert().values(version=version))
        code, out = _check(cfg)
        assert code == code_wanted and said in _line(out, "ledger"), out
    db.dispose()
    result = json.loads(_check(cfg, "--json")[1])
    assert result["exit_code"] == 2 and [c["name"] for c in result["checks"]] == [
        "ledger", "inbox", "outbox", "archive", "failed", "logs", "model", "grades"]  # the newer ledger is not looked
    # into


def test_check_says_when_the_originals_waiting_in_a_shared_ledger_cannot_be_reached(tmp_path, tiny_model_dir,
                                                                                     ledger_url):
    """A document taken in by another machine from a folder this one does not have (a share not mounted): its
    worker could not read the original there."""
    from db.models import Document
    from ingest.intake.enqueue import intake_file
    from tests.conftest import make_pdf

    cfg = worker_config(tmp_path, tiny_model_dir, database={"url": ledger_url})
    settings = load_settings(cfg)
    settings.ensure_folders()
    db = Database(settings.database_url)
    intake_file(db, settings, make_pdf(settings.inbox / "here.pdf", 1))
    code, out = _check(cfg)
    assert code == 0 and "the originals of the documents waiting are reachable here (1 folder)" in out, out
    with db.session() as s, s.begin():
        s.add(Document(sha256="c" * 64, original_path="/mnt/scans-of-another-machine/inbox/x.pdf",
                       original_name="x.pdf", size_bytes=1, mtime_ns=1, kind="pdf", page_count=1))
    db.dispose()
    code, out = _check(cfg)
    assert code == 2, out
    assert "FAILED" in _line(out, "shared") and "/mnt/scans-of-another-machine/inbox" in _line(out, "shared")


def test_check_names_what_is_wrong(tmp_path, pg_server):
    """An unreachable database server (exit 5; the password never shown), a folder that is a file, a missing model."""
    url = pg_server.url_of("uflash").replace("postgres@", "archivist:s3cret@").replace(
        f"port={pg_server.port}", "port=9")  # nothing listens on port 9
    (tmp_path / "archive").write_text("a file where the archive folder should be")
    cfg = write_config(tmp_path, database={"url": url}, model={"path": str(tmp_path / "no-model")})
    code, out = _check(cfg)
    assert code == 5, out
    assert "FAILED" in _line(out, "ledger") and "cannot be reached" in _line(out, "ledger")
    assert "s3cret" not in out and "archivist:***@" in out
    assert "FAILED" in _line(out, "archive") and "a file, not a folder" in _line(out, "archive")
    assert "FAILED" in _line(out, "model") and "not found" in _line(out, "model")
    assert out.rstrip().endswith("not ready: see FAILED above")
