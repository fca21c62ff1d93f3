"""The end of every benchmark: its record written (indented) where ``--json`` points, and printed as one JSON line."""

from __future__ import annotations

import json
from pathlib import Path


def save(report: dict, path: Path | None) -> None:
    """Write ``report`` to ``path`` (folders made), if given; without printing (a record kept while a run goes on)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))


def finish(report: dict, path: Path | None) -> None:
    """Save ``report`` and print it as the benchmark's last line."""
    save(report, path)
    print(json.dumps(report, separators=(",", ":")))
