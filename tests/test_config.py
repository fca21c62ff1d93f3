import json
import os
from pathlib import Path

import pytest

from ingest.config import Settings, load_settings
from ingest.errors import ConfigError
from tests.conftest import uflash, write_config


def test_defaults_and_relative_paths(tmp_path):
    cfg = write_config(tmp_path)
    s = load_settings(cfg)
    assert s.inbox == (tmp_path / "inbox").resolve()
    assert s.database_url == f"sqlite:///{(tmp_path / 'uflash.db').resolve()}"
    assert s.worker.max_attempts == 3


def test_environment_overrides_file(tmp_path, monkeypatch):
    cfg = write_config(tmp_path, watch={"settle_seconds": 1.0})
    monkeypatch.setenv("UFLASH_WATCH__SETTLE_SECONDS", "7.5")
    monkeypatch.setenv("UFLASH_WORKER__MAX_ATTEMPTS", "9")
    s = load_settings(cfg)
    assert s.watch.settle_seconds == 7.5
    assert s.worker.max_attempts == 9
    assert s.watch.rescan_seconds == 2.0  # the rest of the section still comes from the file


def test_shipped_config_toml_loads(monkeypatch):
    """The repository's own config.toml is valid (every key it names exists) and keeps the safe defaults."""
    for key in [k for k in os.environ if k.startswith("UFLASH_")]:
        monkeypatch.delenv(key)
    s = load_settings(Path(__file__).resolve().parents[1] / "config.toml")
    shipped, builtin = s.model_dump(), Settings().model_dump()
    assert shipped["engine"].pop("max_pages_per_chunk") == 4  # the one key it sets apart: the demo model's 1-4 pages
    builtin["engine"].pop("max_pages_per_chunk")
    assert shipped == builtin
    assert (s.engine.mode, s.quality.repair, s.orientation.auto, s.model.path) == ("lossless", True, True, "models/demo")
    # the defaults that keep a night's work safe, each by its value: exact text, every output, a file taken only once
    # it is complete, a lease that outlives several missed heartbeats, a few attempts with a pause before each
    assert (s.model.device, s.model.dtype, s.engine.max_batch, s.engine.kernels) == ("auto", "auto", "auto", "auto")
    assert s.outputs.formats == ["md", "json", "pdf", "alto"] and s.database.url == "sqlite:///var/uflash.db"
    assert (s.watch.settle_seconds, s.watch.incomplete_grace_seconds, s.watch.rescan_seconds) == (5.0, 600.0, 60.0)
    assert (s.worker.lease_seconds, s.worker.heartbeat_seconds) == (300.0, 30.0)
    assert (s.worker.max_attempts, s.worker.backoff_seconds) == (3, 30.0)
    assert s.engine.max_tokens_per_page is None and s.watch.max_page_pixels == 150_000_000


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"watch": {"settle_seconds": "abc"}}, "watch.settle_seconds"),
        ({"worker": {"max_attempts": 2.5}}, "worker.max_attempts"),
        ({"watch": {"settle_secs": 3}}, "unknown config key 'watch.settle_secs'"),
        ({"bogus": {"x": 1}}, "unknown config key 'bogus'"),
    ],
)
def test_bad_config_is_one_line_naming_the_key_exit_2(tmp_path, section, expected):
    cfg = write_config(tmp_path, **section)
    r = uflash("--config", str(cfg), "status")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert expected in lines[0]


def test_bad_environment_value_names_the_key(tmp_path):
    cfg = write_config(tmp_path)
    r = uflash("--config", str(cfg), "status", env={"UFLASH_WORKER__LEASE_SECONDS": "soon"})
    assert r.returncode == 2
    assert "worker.lease_seconds" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_config_file(tmp_path):
    r = uflash("--config", str(tmp_path / "nope.toml"), "status")
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_output_folder_inside_inbox_refused(tmp_path):
    s = load_settings(write_config(tmp_path, folders={"outbox": "inbox/out"}))
    with pytest.raises(ConfigError, match="inside folders.inbox"):
        s.check_folders()
    cfg = write_config(tmp_path, folders={"failed": "inbox/failed"})
    r = uflash("--config", str(cfg), "watch")
    assert r.returncode == 2 and "folders.failed" in r.stderr


def test_status_json_on_empty_ledger(tmp_path):
    cfg = write_config(tmp_path)
    r = uflash("--config", str(cfg), "status", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["documents"]["total"] == 0 and st["chunks"]["total"] == 0
    assert "no ledger at" in r.stderr and st["ledger"].endswith("uflash.db")


def test_reading_commands_never_create_a_ledger(tmp_path):
    cfg = write_config(tmp_path)
    db_file = Path(load_settings(cfg).database_url[len("sqlite:///"):])
    assert uflash("--config", str(cfg), "status").returncode == 0
    r = uflash("--config", str(cfg), "report")
    assert r.returncode == 2 and "no ledger at" in r.stderr
    assert not db_file.exists()
