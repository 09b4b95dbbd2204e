"""One connection to the job database, SQLite (embedded) or PostgreSQL (a fleet across hosts), spoken
in one SQL: statements use ``?`` marks and the few words that differ come from the ``Database``
(``serial``, ``blob``, ``now``, ``skip_locked``), so every query is written once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from fv_core.errors import ConfigError

SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"  # unix seconds, the database's clock
POSTGRES_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::float8"


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


class Database:
    """A connection in autocommit mode; ``transaction()`` groups statements (one writer at a time)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.postgres = url.startswith(("postgresql://", "postgres://"))
        if self.postgres:
            self.conn: Any = _connect_postgres(url)
            self.where = f"database {redact(url)!r}"
        else:
            path = Path(url.removeprefix("sqlite://"))
            self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.where = f"data dir {str(path.parent)!r}"
        # the words that differ between the two
        self.serial = "BIGSERIAL PRIMARY KEY" if self.postgres else "INTEGER PRIMARY KEY AUTOINCREMENT"
        self.blob = "BYTEA" if self.postgres else "BLOB"
        self.now = POSTGRES_NOW if self.postgres else SQLITE_NOW
        self.skip_locked = " FOR UPDATE SKIP LOCKED" if self.postgres else ""  # SQLite has one writer

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        """Run one statement; the cursor answers ``fetchone``, ``fetchall`` and ``rowcount``."""
        return self.conn.execute(sql.replace("?", "%s") if self.postgres else sql, tuple(args))

    def executemany(self, sql: str, rows: list[Sequence[Any]]) -> None:
        if self.postgres:
            with self.conn.cursor() as cur:
                cur.executemany(sql.replace("?", "%s"), rows)
        else:
            self.conn.executemany(sql, rows)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Statements that commit together; SQLite takes its write lock at the start (``IMMEDIATE``)."""
        if self.postgres:
            with self.conn.transaction():
                yield
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:  # never leave the shared connection inside one
                self.conn.execute("ROLLBACK")
            raise

    def columns(self, table: str) -> set[str]:
        if self.postgres:
            rows = self.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name=?", (table,)
            )
            return {r[0] for r in rows.fetchall()}
        return {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})")}

    def close(self) -> None:
        self.conn.close()


def _connect_postgres(url: str) -> Any:
    try:
        import psycopg
    except ImportError:
        raise ConfigError(
            f"store {redact(url)!r} needs psycopg 3, which is not installed. Fix: pip install 'fv-core[postgres]'."
        ) from None
    try:
        return psycopg.connect(url, autocommit=True)
    except psycopg.OperationalError as exc:
        raise ConfigError(
            f"cannot connect to the job store {redact(url)!r}: {str(exc).strip()}. Fix: start the PostgreSQL "
            "server, or correct the deploy's store URL (postgresql://user:password@host:port/database)."
        ) from None
