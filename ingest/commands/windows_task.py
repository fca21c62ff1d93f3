"""The Windows Task Scheduler definition that keeps ``uflash watch`` running on an unattended workstation.

``uflash windows-task`` writes it as Task Scheduler XML, to import with
``schtasks /Create /TN uflash /XML uflash-task.xml`` (or Task Scheduler > Import Task). What it sets, and why:

- starts at boot (``BootTrigger``), whether anyone is logged on, and again when a missed start becomes possible;
- **no time limit** (``ExecutionTimeLimit PT0S``): a task made by hand stops after 3 days by default, which
  silently ends a watcher in the middle of a long batch;
- restarts after a crash every minute, up to 999 times (a restart redoes at most the chunk in hand);
- one instance at a time (a second ``watch`` would only wait on the first one's leases);
- runs on battery and does not stop when the machine goes on battery (a laptop at a reading-room desk);
- the command is this Python with ``-m ingest.commands.cli watch --config <the config>``, in the config's folder, so it
  does not depend on PATH or on where ``uflash.exe`` was installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from xml.sax.saxutils import escape

NAMESPACE = "http://schemas.microsoft.com/windows/2004/02/mit/task"


def task_xml(config: Path, python: str | None = None, user: str | None = None) -> str:
    """The task definition for ``uflash watch`` with ``config`` (absolute), run by ``python`` (default: this
    interpreter) as ``user`` (default: the SYSTEM account; a named user needs its password once at import)."""
    config = Path(config).absolute()
    python = python or sys.executable
    args = f'-m ingest.commands.cli --config "{config}" watch'
    if user:
        principal = f"<UserId>{escape(user)}</UserId>\n      <LogonType>Password</LogonType>"
    else:
        principal = "<UserId>S-1-5-18</UserId>"  # LocalSystem
    return f"""<?xml version="1.0" encoding="UTF-16"?>
<Task version="1.2" xmlns="{NAMESPACE}">
  <RegistrationInfo>
    <Description>uflash: watch-folder OCR (uflash watch --config {escape(str(config))})</Description>
  </RegistrationInfo>
  <Triggers>
    <BootTrigger>
      <Enabled>true</Enabled>
    </BootTrigger>
  </Triggers>
  <Principals>
    <Principal id="Author">
      {principal}
      <RunLevel>LeastPrivilege</RunLevel>
    </Principal>
  </Principals>
  <Settings>
    <MultipleInstancesPolicy>IgnoreNew</MultipleInstancesPolicy>
    <DisallowStartIfOnBatteries>false</DisallowStartIfOnBatteries>
    <StopIfGoingOnBatteries>false</StopIfGoingOnBatteries>
    <StartWhenAvailable>true</StartWhenAvailable>
    <RunOnlyIfNetworkAvailable>false</RunOnlyIfNetworkAvailable>
    <IdleSettings>
      <StopOnIdleEnd>false</StopOnIdleEnd>
      <RestartOnIdle>false</RestartOnIdle>
    </IdleSettings>
    <Enabled>true</Enabled>
    <Hidden>false</Hidden>
    <RunOnlyIfIdle>false</RunOnlyIfIdle>
    <ExecutionTimeLimit>PT0S</ExecutionTimeLimit>
    <Priority>7</Priority>
    <RestartOnFailure>
      <Interval>PT1M</Interval>
      <Count>999</Count>
    </RestartOnFailure>
  </Settings>
  <Actions Context="Author">
    <Exec>
      <Command>{escape(python)}</Command>
      <Arguments>{escape(args)}</Arguments>
      <WorkingDirectory>{escape(str(config.parent))}</WorkingDirectory>
    </Exec>
  </Actions>
</Task>
"""


def write_task_xml(out: Path, config: Path, python: str | None = None, user: str | None = None) -> Path:
    """Write the definition in UTF-16 with a byte-order mark, as ``schtasks /XML`` reads it."""
    out = Path(out)
    out.write_bytes(task_xml(config, python, user).encode("utf-16"))
    return out
