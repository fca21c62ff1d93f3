"""The suite runs on two workers (pytest-xdist, ``--dist loadgroup``), and the modules whose tests share one costly
module fixture (a finished run, a browser, a demo-model run) or build on each other's acts mark themselves
``xdist_group``: their tests must land on one worker. pytest 9.2 keeps a test's id where pytest-xdist 3.8 cannot add
the group to it, and the marks are then silently ignored (each worker builds the fixture again, and tests that build
on an earlier one's acts fail): pyproject.toml holds pytest below 9.2, and this test fails if grouping stops working."""

from __future__ import annotations

import os
import subprocess
import sys

GROUPED = '''
import os
import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("i", range(6))
def test_where(i):
    with open(os.path.join(os.environ["GROUPED_OUT"], f"ran-{i}"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
'''


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --dist loadgroup\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"], cwd=tmp_path,
                       env={**os.environ, "GROUPED_OUT": str(tmp_path)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    workers = {p.read_text() for p in tmp_path.glob("ran-*")}
    assert len(list(tmp_path.glob("ran-*"))) == 6 and len(workers) == 1, (workers, r.stdout)
