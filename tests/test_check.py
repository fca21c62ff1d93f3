"""`uflash check`: the set-up of a machine (ledger, folders, model) checked without changing anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from db.models import SchemaVersion
from db.session import SCHEMA_VERSION, Database
from ingest.config import BUNDLED_DEMO_MODEL, load_settings
from tests.conftest import ROOT, needs_demo, uflash, worker_config, write_config


def _check(cfg, *args):
    r = uflash("--config", str(cfg), "check", *args)
    return r.returncode, r.stdout + r.stderr


def _line(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(name + " "))


def _elsewhere(folder, *args, env: dict | None = None):
    """``uflash ARGS`` started in ``folder`` (no config.toml there, none named), as a newcomer's shell would."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UFLASH_")}
    return subprocess.run([sys.executable, "-m", "ingest.commands.cli", *args], cwd=folder, capture_output=True,
                          text=True, timeout=120, env={**clean, "PYTHONPATH": str(ROOT), **(env or {})})


def test_outside_the_project_folder_check_fails_where_run_fails_and_neither_leaves_anything(tmp_path):
    """In a folder without config.toml, with model.path a checkpoint not downloaded (relative, so that it also looks
    like a hub id): `check` fails with the very line `run` stops with (exit 3 both), the line says that no config file
    was found, where model.path came from and how to point it at a checkpoint (never to download into the demo
    model's folder); the run leaves no ledger, no folders."""
    pdf = tmp_path / "s.pdf"
    pdf.write_bytes((ROOT / "examples" / "sample.pdf").read_bytes())
    env = {"UFLASH_MODEL__PATH": "models/Unlimited-OCR", "HF_HOME": str(tmp_path / "no-hf-cache"), "HF_HUB_OFFLINE": "1"}
    check = _elsewhere(tmp_path, "check", env=env)
    assert check.returncode == 3, check.stdout + check.stderr
    assert _line(check.stdout, "config").split(None, 2)[1:] == [
        "ok", f"no config.toml in {tmp_path}, no --config, no $UFLASH_CONFIG: built-in defaults, relative paths under "
              f"{tmp_path}"]
    model = _line(check.stdout, "model")
    assert model.split()[1] == "FAILED", check.stdout
    reason = model.split(None, 2)[2]
    run = _elsewhere(tmp_path, "run", "s.pdf", env=env)
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"uflash: error: {reason}"
    assert reason.startswith("model not found at models/Unlimited-OCR: no such folder")
    assert "from UFLASH_MODEL__PATH" in reason and f"no config.toml in {tmp_path}" in reason
    assert f"--local-dir {tmp_path / 'models' / 'Unlimited-OCR'}`" in reason and "model.path" in reason
    assert "models/demo" not in reason
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pdf"]  # no var/, no ledger: nothing but the file
    assert pdf.read_bytes() == (ROOT / "examples" / "sample.pdf").read_bytes()


@needs_demo
def test_outside_the_project_folder_the_bundled_demo_model_is_the_default(tmp_path, monkeypatch):
    """No config file and model.path not set: the demo model that ships with uflash, wherever uflash starts, and
    `check` says so (and that the defaults are used); a model.path set in a config file keeps its meaning."""
    r = _elsewhere(tmp_path, "check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"no config.toml in {tmp_path}" in _line(r.stdout, "config")
    assert _line(r.stdout, "model").split(None, 2)[1:] == [
        "ok", f"{BUNDLED_DEMO_MODEL} (model.path not set: the demo model bundled with uflash)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UFLASH_CONFIG", raising=False)
    monkeypatch.delenv("UFLASH_MODEL__PATH", raising=False)
    assert load_settings().model_path == str(BUNDLED_DEMO_MODEL)
    assert load_settings().on_device("cpu").model_path == str(BUNDLED_DEMO_MODEL)  # --device keeps it unset
    (tmp_path / "models" / "demo").mkdir(parents=True)
    cfg = write_config(tmp_path, model={"path": "models/demo"})
    assert load_settings(cfg).model_path == str(tmp_path / "models" / "demo")  # set: against the config's folder


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
    assert code == 0 and f"schema version {SCHEMA_VERSION}, the one this uflash uses" in _line(out, "ledger"), out
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
        "config", "ledger", "inbox", "outbox", "archive", "failed", "logs", "model", "grades"]  # the newer ledger is not looked
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
