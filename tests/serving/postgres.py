"""A throwaway PostgreSQL cluster (Debian's ``postgresql``: initdb + pg_ctl) on a temporary folder and a
free port, for the tests and ``bench/fleet.py``. initdb refuses root, so as root the cluster runs as the
unprivileged ``postgres`` user (``runuser``); as anyone else, as that user."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from tests.serving.support import free_port


def bin_dir() -> Path | None:
    """The newest installed PostgreSQL's bin folder, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PostgresCluster:
    """``with PostgresCluster() as pg: pg.database()`` -> the URL of a fresh, empty database."""

    def __init__(self, fsync: bool = False) -> None:
        self.bin = bin_dir()
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed. Fix: apt-get install postgresql (.ci/run does).")
        self.fsync = fsync  # off in tests: a crash of the test machine loses nothing that matters
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self.root = Path(tempfile.mkdtemp(prefix="fv-pg-"))
        self.data = self.root / "data"

    def _run(self, *args: str) -> None:
        command = [str(self.bin / args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", self.user, "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self.root)

    def __enter__(self) -> PostgresCluster:
        if os.geteuid() == 0:
            shutil.chown(self.root, self.user)
        self._run("initdb", "-D", str(self.data), "-U", "fv", "--auth=trust", "-E", "UTF8")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not self.fsync:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start")
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://fv@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database's URL (each test its own: the cluster starts once per session)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def __exit__(self, *exc: object) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
