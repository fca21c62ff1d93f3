"""Logging: loguru to the console and to a rotating file in the logs folder."""

from __future__ import annotations

import sys
from pathlib import Path

from loguru import logger


def setup_logging(log_dir: Path | None, verbose: bool = False, quiet: bool = False) -> None:
    logger.remove()
    level = "DEBUG" if verbose else ("WARNING" if quiet else "INFO")
    logger.add(sys.stderr, level=level, format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        logger.add(log_dir / "uflash.log", level="DEBUG", rotation="10 MB", retention=10, encoding="utf-8",
                   enqueue=True, format="{time:YYYY-MM-DD HH:mm:ss.SSS} {process} {level: <7} {name}:{line} {message}")
