"""Logging, progress bars and counted nouns: loguru to the console and to a rotating file in the logs folder.
Console lines go through ``tqdm.write``, so that a line logged while a progress bar is drawn comes out on a line of
its own and the bar below it. Quiet (``-q``): warnings and errors only, and no progress bars (``progress_bar`` draws
nothing; transformers' and the Hugging Face hub's own bars are switched off too).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from loguru import logger
from tqdm import tqdm

_console_state: dict[str, Any] = {"bars": True, "stream": sys.stderr}  # bars off with -q; the console's error
# stream as it was at set-up (a library that swaps sys.stderr for a while, OCRmyPDF's, does not swallow our lines)


def setup_logging(log_dir: Path | None, verbose: bool = False, quiet: bool = False) -> None:
    logger.remove()
    _console_state["stream"] = sys.stderr
    level = "DEBUG" if verbose else ("WARNING" if quiet else "INFO")
    logger.add(_console, level=level, colorize=_is_terminal(),
               format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        logger.add(log_dir / "uflash.log", level="DEBUG", rotation="10 MB", retention=10, encoding="utf-8",
                   enqueue=True, format="{time:YYYY-MM-DD HH:mm:ss.SSS} {process} {level: <7} {name}:{line} {message}")
    _console_state["bars"] = not quiet
    if quiet:
        _silence_library_bars()


def progress_bar(total: int, desc: str, disable: bool = False, **kw: Any) -> tqdm:
    """A progress bar on the console's error stream (``kw``: tqdm's); one that draws nothing when bars are off
    (``-q``) or ``disable``."""
    return tqdm(total=total, desc=desc, dynamic_ncols=True, file=_console_state["stream"],
                disable=disable or not _console_state["bars"], **kw)


def counted(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless one: "1 page", "2 pages", "0 chunks"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _console(message: Any) -> None:
    """loguru's console sink: the line above any progress bar, never glued to the end of its line."""
    tqdm.write(str(message), file=_console_state["stream"], end="")


def _is_terminal() -> bool:
    try:
        return _console_state["stream"].isatty()
    except (AttributeError, ValueError):
        return False


def _silence_library_bars() -> None:
    """The hub's progress bars off, and with them transformers' ("Loading weights": it reads the hub's setting when
    it is imported, or is told here if it already is)."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    if (loaded := sys.modules.get("transformers.utils.logging")) is not None:
        loaded.disable_progress_bar()
