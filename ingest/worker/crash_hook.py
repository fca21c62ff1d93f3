"""Test-only: a worker that dies on a marked document, as one dies on a page that crashes the decoder (a segfault in a
kernel, the system's out-of-memory killer), so that the tests can make a poison document.

With ``UFLASH_TEST_KILL_ON_PAGE_TEXT=<marker>`` in its environment, a worker kills its own process outright (SIGKILL:
nothing is cleaned up or given back) the moment it submits to the decoder a chunk whose label (the document's file
name and pages) or one of whose pages' text layer contains the marker. Unset, as it always is outside the tests,
it does nothing. Used by tests/test_crashes.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

from loguru import logger

VARIABLE = "UFLASH_TEST_KILL_ON_PAGE_TEXT"


def before_decode(label: str, texts: Iterable[str | None]) -> None:
    """Kill this process when the marker is set and in ``label`` or one of ``texts`` (see the module docstring)."""
    marker = os.environ.get(VARIABLE)
    if marker and (marker in label or any(marker in (t or "") for t in texts)):
        logger.warning("{} holds the test marker of {}: killing this process", label, VARIABLE)
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
