"""A throw-away PostgreSQL server for tests: initdb in a temp folder, listening on a Unix socket only.

PostgreSQL refuses to run as root, so when the tests run as root the server runs as the ``postgres``
system user (created by Debian's package). ``start_postgres`` returns None when no server binaries exist.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    hits = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return hits[-1] if hits else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PgServer:
    folder: Path
    port: int
    as_user: list[str]
    max_connections: int = 50

    @property
    def url(self) -> str:
        return self.url_of("postgres")

    def url_of(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@/{database}?host={self.folder}&port={self.port}"

    def start(self) -> None:
        """Start the server (again, after ``stop``) on its folder and port."""
        opts = (f"-p {self.port} -k {self.folder} -c listen_addresses='' -c fsync=off "
                f"-c max_connections={self.max_connections}")
        subprocess.run([*self.as_user, _bin("pg_ctl"), "-D", str(self.folder / "data"), "-o", opts,
                        "-l", str(self.folder / "log"), "-w", "start"], check=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        subprocess.run([*self.as_user, _bin("pg_ctl"), "-D", str(self.folder / "data"), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(host=str(self.folder), port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(sql)

    def create_database(self, name: str) -> str:
        """A new empty database on this server; returns its URL."""
        self._admin(f'CREATE DATABASE "{name}"')
        return self.url_of(name)

    def drop_database(self, name: str) -> None:
        """Drop the database, ending the connections still open to it."""
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_postgres(folder: Path, max_connections: int = 50) -> PgServer | None:
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if not initdb or not pg_ctl:
        return None
    as_user: list[str] = []
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        folder.mkdir(parents=True, exist_ok=True)
        shutil.chown(folder, "postgres", "postgres")
        os.chmod(folder, 0o755)
        for parent in folder.parents:  # the postgres user must be able to reach the folder
            if str(parent) in ("/", "/tmp"):
                break
            os.chmod(parent, os.stat(parent).st_mode | 0o011)
    data = folder / "data"
    subprocess.run([*as_user, initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True, timeout=120)
    server = PgServer(folder, _free_port(), as_user, max_connections)
    server.start()
    return server
