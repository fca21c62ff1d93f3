"""File-system helpers: hashing, the one naming rule where names collide, moving without overwriting, atomic writes,
completeness checks, and a path or a uflash command as a person pastes it into a shell."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

# Names that copy tools and browsers use while a file is still arriving, and our own side files.
TEMP_SUFFIXES = (".part", ".partial", ".crdownload", ".download", ".tmp", ".temp", ".error.txt", ".!ut")


def is_ignored_name(name: str) -> bool:
    low = name.lower()
    return low.startswith((".", "~$", "~")) or low.endswith(TEMP_SUFFIXES)


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def can_open_exclusively(path: Path) -> bool:
    """True when no other program holds the file open for writing (as far as the OS lets us tell).

    Windows refuses a read-write open of a file that a copier still has open; on POSIX an exclusive
    advisory lock catches writers that lock, and the settle time catches the rest."""
    try:
        if sys.platform == "win32":
            fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
            os.close(fd)
            return True
        import fcntl

        with open(path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True
    except OSError:
        return False


def free_name(name: str, taken: Callable[[str], bool]) -> str:
    """``name``, or ``stem (2).ext``, ``stem (3).ext`` ... : the first name ``taken`` does not refuse. The one rule
    for a name already in use: in the archive, failed/, archive/duplicates, the inbox (a retried file), and for an
    original's outputs (ingest.worker.finish names its outbox folder and archived original alike)."""
    stem, suffix = Path(name).stem, Path(name).suffix
    candidate, n = name, 2
    while taken(candidate):
        candidate = f"{stem} ({n}){suffix}"
        n += 1
    return candidate


def unique_destination(folder: Path, name: str) -> Path:
    """``folder/name`` under the first name ``free_name`` gives that holds no file (nor a file's ``.error.txt``):
    never overwrite a file."""
    folder.mkdir(parents=True, exist_ok=True)
    return folder / free_name(name, lambda n: (folder / n).exists() or (folder / f"{n}.error.txt").exists())


def move_file(src: Path, folder: Path, name: str | None = None) -> Path:
    """``src`` moved into ``folder`` under ``name`` (default: its own), or the next free name."""
    dest = unique_destination(folder, name or src.name)
    shutil.move(str(src), str(dest))
    return dest


def is_inside(path: Path, folder: Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(Path(folder).resolve())
    except OSError:
        return False


def file_away(src: Path, folder: Path, inbox: Path, name: str | None = None) -> Path:
    """Put ``src`` into ``folder`` under ``name`` (default: its own) or the next free name: moved when it came through
    the inbox (what is dropped there is uflash's to take), copied when the user named it elsewhere (``uflash run
    PATH``): uflash never moves or deletes a file outside its inbox."""
    if is_inside(src, inbox):
        return move_file(src, folder, name)
    dest = unique_destination(folder, name or src.name)
    shutil.copy2(str(src), str(dest))
    return dest


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename over the target.

    The temp file is created with mode 0666 less the umask, as a plain ``open()`` would (``mkstemp`` gives 0600,
    which locks out the archivist when a service account writes the outputs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    mode = "wb" if isinstance(data, bytes) else "w"
    try:
        with os.fdopen(fd, mode, **({} if isinstance(data, bytes) else {"encoding": "utf-8", "newline": "\n"})) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def shell_arg(s: str) -> str:
    """``s`` as one argument in a POSIX shell and in Windows cmd (double quotes only where needed)."""
    return s if re.fullmatch(r"[\w./:\\=+-]+", s) else '"' + s.replace('"', '\\"') + '"'


def uflash_command(config_file: Path | str | None, *args: str | Path) -> str:
    """``uflash [--config FILE] ARGS...`` as a person pastes it into a shell (the config named when one was read)."""
    config = ("--config", str(config_file)) if config_file else ()
    return " ".join(["uflash", *(shell_arg(str(a)) for a in (*config, *args))])
