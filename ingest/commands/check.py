"""``uflash check``: can this machine work with this configuration? It reaches the ledger (and says which server and
which schema version it holds, without changing anything), looks at every folder (there, or creatable; writable; free
space) and at the model folder, found as ``uflash run`` finds it; it says which config file it read, or that none was
found. Run it on each machine that is to work on a shared ledger before starting ``uflash watch`` there.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from db.overview import ledger_facts
from db.session import SCHEMA_VERSION, LedgerUrlError, masked_url
from ingest.config import Settings
from ingest.errors import ConfigError, InfrastructureError, ModelUnavailable, UflashError, infrastructure_problem
from ingest.quality.calibration import grading_thresholds
from ingest.worker.model_files import locate_model, model_origin

FOLDERS = ("inbox", "outbox", "archive", "failed", "logs")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fault: type[UflashError] | None = None  # the kind of failure (the CLI maps it to `uflash check`'s exit code)


def check_ledger(settings: Settings) -> tuple[Check, list[str], list[str]]:
    """Reach the ledger and read its schema version (read only). Returns the check, the owners of its open runs (the
    workers at work on it now, or that stopped without closing their run) and the folders of the originals of the
    documents waiting in it."""
    url = settings.database_url
    shown = masked_url(url)
    if url.startswith("sqlite:///") and ":memory:" not in url:
        path = Path(url[len("sqlite:///"):])
        if not path.exists():
            there = _nearest_existing(path.parent)
            if there is None or not _writable(there):
                return Check("ledger", False, f"{shown}: no ledger, and {path.parent} cannot be created",
                             ConfigError), [], []
            return Check("ledger", True, f"{shown}: no ledger yet; the first `uflash watch` or `uflash run` "
                                         f"creates it (schema version {SCHEMA_VERSION})"), [], []
    try:
        facts = ledger_facts(url, settings.database.busy_timeout_ms)
    except LedgerUrlError as e:
        detail = f"its database driver is not installed ({e.driver}): pip install -e \".[postgres]\"" if e.driver \
            else f"not a usable database URL: {e}"
        return Check("ledger", False, f"{shown}: {detail}", ConfigError), [], []
    except Exception as e:
        problem = infrastructure_problem(e) or f"{type(e).__name__}: {e}"
        return Check("ledger", False, f"{shown}: cannot be reached: {problem}", InfrastructureError), [], []
    version, server = facts.version, facts.server
    if version is None:
        schema = f"empty: the first `uflash watch` or `uflash run` creates its tables (schema version {SCHEMA_VERSION})"
    elif version == SCHEMA_VERSION:
        schema = f"schema version {version}, the one this uflash uses"
    elif version < SCHEMA_VERSION:
        schema = f"schema version {version}: the first start of this uflash migrates it to {SCHEMA_VERSION}"
    else:
        return Check("ledger", False, f"{shown} ({server}): schema version {version} is newer than this uflash's "
                                      f"({SCHEMA_VERSION}): upgrade uflash on this machine", ConfigError), [], []
    folders = sorted({str(Path(p).parent) for p in facts.waiting_originals})
    return Check("ledger", True, f"{shown} ({server}): {schema}"), facts.open_run_owners, folders


def check_waiting_originals(folders: list[str]) -> Check:
    """The folders that the documents waiting in the ledger were taken in from: a worker reads the originals there
    (on a shared ledger, whichever machine took a file in)."""
    missing = [f for f in folders if not Path(f).is_dir()]
    if missing:
        return Check("shared", False, f"documents wait in the ledger at folders this machine cannot reach: "
                                      f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (every worker "
                                      f"needs the inbox at the same path: mount the share there)", ConfigError)
    if not folders:
        return Check("shared", True, "no document waits in the ledger")
    return Check("shared", True, f"the originals of the documents waiting are reachable here ({len(folders)} "
                                 f"folder{'s' if len(folders) != 1 else ''})")


def _nearest_existing(p: Path) -> Path | None:
    for q in (p, *p.parents):
        if q.exists():
            return q if q.is_dir() else None
    return None


def _writable(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".uflash-check-"):
            return True
    except OSError:
        return False


def check_folder(settings: Settings, name: str) -> Check:
    p = getattr(settings, name)
    if p.exists() and not p.is_dir():
        return Check(name, False, f"{p}: a file, not a folder (folders.{name})", ConfigError)
    if not p.exists():
        there = _nearest_existing(p)
        if there is None or not _writable(there):
            return Check(name, False, f"{p}: missing, and cannot be created here (folders.{name})", ConfigError)
        return Check(name, True, f"{p}: not there yet; created at the first start")
    if not _writable(p):
        return Check(name, False, f"{p}: cannot write in it (folders.{name})", ConfigError)
    free = shutil.disk_usage(p).free
    return Check(name, True, f"{p}: writable, {_size(free)} free")


def check_model(settings: Settings) -> Check:
    """The model's files, found as ``uflash run`` and the worker find them (the same line when they are not there)."""
    try:
        folder = locate_model(settings)
    except ModelUnavailable as e:
        return Check("model", False, str(e), ModelUnavailable)
    return Check("model", True, f"{folder} ({model_origin(settings)})")


def check_config(settings: Settings) -> Check:
    """Which config file was read, or that none was found and the built-in defaults hold."""
    return Check("config", True, settings.source())


def check_grades(settings: Settings) -> Check:
    """Whether the model's grades are calibrated for it (ingest.quality.calibration): never a failure, said plainly."""
    return Check("grades", True, grading_thresholds(settings).summary())


def run_checks(settings: Settings) -> dict[str, Any]:
    """Every check, in order, with the owners of the ledger's open runs (a failed check's ``fault`` says what kind of
    failure it is)."""
    checks = [check_config(settings)]
    try:
        settings.check_folders()
    except ConfigError as e:
        checks.append(Check("folders", False, str(e), ConfigError))
    ledger, owners, originals = check_ledger(settings)
    checks.append(ledger)
    checks += [check_folder(settings, name) for name in FOLDERS]
    if ledger.ok:
        checks.append(check_waiting_originals(originals))
    checks.append(model := check_model(settings))
    if model.ok:
        checks.append(check_grades(settings))
    return {"checks": [asdict(c) for c in checks], "open_runs_of": owners, "ok": all(c.ok for c in checks)}


def format_checks(result: dict[str, Any]) -> str:
    lines = [f"{c['name']:<8} {'ok' if c['ok'] else 'FAILED':<6} {c['detail']}" for c in result["checks"]]
    if result["open_runs_of"]:
        lines.append(f"{'workers':<8} {'':<6} open runs on this ledger: {', '.join(result['open_runs_of'])}")
    lines.append("all good" if result["ok"] else "not ready: see FAILED above")
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
