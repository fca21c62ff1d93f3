"""What the console shows (ingest.logs): log lines on lines of their own while a progress bar is drawn, nothing of
the bars with ``-q``, counted nouns; a diff with nothing to compare."""

from __future__ import annotations

import io
import re
import sys
import threading

import pytest
from loguru import logger

from ingest import logs
from ingest.commands.rerun import format_diff
from ingest.logs import counted, progress_bar, setup_logging

LOG_LINE = re.compile(r"\d\d:\d\d:\d\d (INFO|SUCCESS|WARNING) ")


@pytest.fixture
def console(monkeypatch):
    """Puts a StringIO in place of the console's error stream when called (pytest's own capture sets sys.stderr
    between a fixture and its test) and returns it; loguru and the libraries' bars as they were, afterwards."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    stream = io.StringIO()
    hub_bars_were_off = are_progress_bars_disabled()
    yield lambda: monkeypatch.setattr(sys, "stderr", stream) or stream
    logger.remove()
    logger.add(sys.__stderr__)
    logs._console_state.update(bars=True, stream=sys.__stderr__)
    if not hub_bars_were_off:
        enable_progress_bars()
        if (loaded := sys.modules.get("transformers.utils.logging")) is not None:
            loaded.enable_progress_bar()


def test_log_lines_never_glue_to_a_progress_bar(console, monkeypatch):
    """Each line logged while the bar is drawn starts a line of its own (the bar is drawn again below it), one logged
    from a thread while a library has swapped sys.stderr for its own buffer included."""
    stream = console()
    setup_logging(None)
    bar = progress_bar(3, "uflash run", unit="page")
    logger.info("first")
    bar.update(1)
    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)  # as OCRmyPDF does while it makes a PDF/A
    t = threading.Thread(target=lambda: logger.success("from the finishing thread"))
    t.start()
    t.join()
    monkeypatch.setattr(sys, "stderr", stream)
    bar.update(1)
    logger.warning("last")
    bar.close()
    out = stream.getvalue()
    assert "uflash run" in out and swapped.getvalue() == ""
    said = [s for s in re.split(r"[\r\n]", out) if LOG_LINE.search(s)]
    assert [LOG_LINE.search(s)[1] for s in said] == ["INFO", "SUCCESS", "WARNING"], out
    assert all(LOG_LINE.match(s) for s in said), f"a log line glued to the bar's line: {said}"


def test_quiet_draws_no_progress_bar_and_silences_the_libraries_bars(console):
    from huggingface_hub.utils import are_progress_bars_disabled

    stream = console()
    setup_logging(None, quiet=True)
    bar = progress_bar(3, "uflash run", unit="page")
    bar.update(3)
    bar.close()
    logger.info("not shown")
    logger.warning("shown")
    assert stream.getvalue().count("\n") == 1 and "WARNING shown" in stream.getvalue(), stream.getvalue()
    assert are_progress_bars_disabled()  # transformers reads this when it is imported ("Loading weights")
    if (loaded := sys.modules.get("transformers.utils.logging")) is not None:
        assert not loaded.is_progress_bar_enabled()


def test_counted_nouns():
    assert [counted(n, "page") for n in (0, 1, 2)] == ["0 pages", "1 page", "2 pages"]


def test_a_diff_with_no_page_in_common_says_so_without_a_table():
    empty = format_diff({"run_a": 1, "run_b": 3, "pages": [], "common_pages": 0, "only_in_a": 2, "only_in_b": 1,
                         "mean_edit_distance": None, "max_edit_distance": None, "identical_pages": 0})
    assert empty.splitlines() == [
        "run 1 vs run 3: 0 pages in both (2 only in 1, 1 only in 3): nothing to compare (a re-run of run 1's pages "
        "is compared with it; `uflash report --run ID` lists a run's pages)"]
