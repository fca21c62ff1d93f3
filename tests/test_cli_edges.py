"""The CLI's edges without a model: file modes of what uflash writes, folders that cannot be used, a closed pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from db.session import Database
from ingest.config import load_settings
from ingest.errors import ConfigError
from ingest.files import write_atomic
from tests.conftest import ROOT, uflash, write_config


def test_write_atomic_gives_the_mode_of_a_plain_open(tmp_path):
    """Not mkstemp's 0600: an archivist other than the service account must be able to read the outputs."""
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a.txt", "text")
        write_atomic(tmp_path / "b.bin", b"\x00\x01")
        write_atomic(tmp_path / "a.txt", "again")  # replacing keeps the mode too
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"a.txt": 0o640, "b.bin": 0o640, "plain.txt": 0o640}, modes  # no temp file left behind
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "again"


@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
def test_unusable_output_folder_is_a_one_line_usage_error(tmp_path, where):
    """`uflash run --out X` where X cannot be a folder: exit 2 and one line naming the folder, no traceback."""
    cfg = write_config(tmp_path)
    blocker = tmp_path / "taken"
    blocker.write_text("a file\n", encoding="utf-8")
    out = {"file": blocker, "under_file": blocker / "sub", "proc": Path("/proc/uflash-outbox")}[where]
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    r = uflash("--config", str(cfg), "run", "--out", str(out), str(blocker))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "unexpected error" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("uflash:")]
    assert f"the outbox folder {out} (folders.outbox) cannot be used: " in line, line
    assert blocker.read_text(encoding="utf-8") == "a file\n"


def test_unusable_logs_folder_is_a_config_error(tmp_path):
    """The logs folder is opened before any command runs: the same one line, exit 2."""
    (tmp_path / "logs").write_text("not a folder\n", encoding="utf-8")
    cfg = write_config(tmp_path)
    with pytest.raises(ConfigError, match="the logs folder .* cannot be used: it is a file, not a folder"):
        load_settings(cfg).ensure_folders()
    r = uflash("--config", str(cfg), "watch", "--intake-only")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "uflash: config error: the logs folder" in r.stderr


@pytest.mark.parametrize("command", ["status", "report"])
def test_closed_output_pipe_exits_quietly(tmp_path, command):
    """`uflash report | head -1`: the reader is gone before uflash writes. A real pipe whose read end is closed
    (what head leaves behind, without the race): no traceback, the SIGPIPE exit status a shell reports."""
    cfg = write_config(tmp_path)
    Database(load_settings(cfg).database_url).dispose()  # a ledger to read (an empty one)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "ingest.commands.cli", "--config", str(cfg), command], cwd=ROOT,
                           stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert r.returncode == 141, r.stderr
    assert r.stderr == "", r.stderr



def test_a_second_stop_signal_exits_at_once(monkeypatch):
    """The first SIGINT/SIGTERM asks loops to finish their step; a second one exits with 130 at once (the chunk in
    progress is redone by the next worker, as after a crash)."""
    import signal as signals

    from ingest.worker import lifecycle

    handlers = {}
    monkeypatch.setattr(lifecycle.signal, "signal", lambda sig, handler: handlers.__setitem__(sig, handler))
    exits = []
    monkeypatch.setattr(lifecycle.os, "_exit", exits.append)
    monkeypatch.setattr(lifecycle.logger, "remove", lambda *a: None)
    stop = lifecycle.stop_event()
    handler = handlers[signals.SIGINT]
    handler(signals.SIGINT, None)
    assert stop.is_set() and exits == []
    handler(signals.SIGINT, None)
    assert exits == [130]


def test_windows_task_xml_starts_watch_at_boot_without_a_time_limit(tmp_path):
    """`uflash windows-task`: Task Scheduler XML (UTF-16, as schtasks /XML reads it) that starts this Python's
    `watch` with this config at boot, never stops it after 3 days (the default of a task made by hand), restarts
    it after a crash and keeps one instance."""
    import xml.etree.ElementTree as ET

    cfg = write_config(tmp_path)
    out = tmp_path / "task.xml"
    r = uflash("--config", str(cfg), "windows-task", "--out", str(out))
    assert r.returncode == 0, r.stderr
    raw = out.read_bytes()
    assert raw[:2] in (b"\xff\xfe", b"\xfe\xff")  # UTF-16 with a byte-order mark
    ns = {"t": "http://schemas.microsoft.com/windows/2004/02/mit/task"}
    root = ET.fromstring(raw.decode("utf-16").split("?>", 1)[1])
    assert root.find("t:Triggers/t:BootTrigger/t:Enabled", ns).text == "true"
    assert root.find("t:Settings/t:ExecutionTimeLimit", ns).text == "PT0S"
    assert root.find("t:Settings/t:MultipleInstancesPolicy", ns).text == "IgnoreNew"
    restart = root.find("t:Settings/t:RestartOnFailure", ns)  # a minute after a crash, 999 times
    assert (restart.find("t:Interval", ns).text, restart.find("t:Count", ns).text) == ("PT1M", "999")
    assert root.find("t:Principals/t:Principal/t:UserId", ns).text == "S-1-5-18"
    exec_ = root.find("t:Actions/t:Exec", ns)
    assert exec_.find("t:Command", ns).text == sys.executable
    assert exec_.find("t:Arguments", ns).text == f'-m ingest.commands.cli --config "{cfg.resolve()}" watch'
    assert exec_.find("t:WorkingDirectory", ns).text == str(cfg.resolve().parent)
    named = uflash("--config", str(cfg), "windows-task", "--out", str(out), "--user", "ARCHIV\\scanner")
    assert named.returncode == 0 and "ARCHIV\\scanner</UserId>" in out.read_bytes().decode("utf-16")
