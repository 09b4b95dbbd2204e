"""The job database's schema, as numbered migrations run at start.

``schema_version`` holds the version a database is at; opening runs the migrations after it, in one
transaction (two replicas starting at once migrate once). A database from before versioning is at 0:
migration 1 brings any earlier shape of the SQLite table to version 1's. A database newer than this fv
is refused with the version and the fix, never written to.
"""

from __future__ import annotations

from collections.abc import Callable

from fv_core.errors import ConfigError
from fv_core.serving.store.db import Database

_JOBS = """
CREATE TABLE IF NOT EXISTS jobs (
    seq {serial},
    id TEXT UNIQUE NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    completed_at BIGINT,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    prompt TEXT,
    error_code TEXT,
    error_message TEXT,
    request TEXT,
    request_id TEXT,
    owner TEXT
)"""
_WEIGHTS = (
    """CREATE TABLE IF NOT EXISTS weight_syncs (
    seq {serial}, model TEXT NOT NULL, plan TEXT NOT NULL, tensors TEXT NOT NULL, file TEXT NOT NULL,
    settled INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS weight_versions (
    model TEXT NOT NULL, component TEXT NOT NULL, version TEXT NOT NULL,
    PRIMARY KEY (model, component, version))""",
    """CREATE TABLE IF NOT EXISTS weight_applied (
    owner TEXT NOT NULL, model TEXT NOT NULL, seq BIGINT NOT NULL, PRIMARY KEY (owner, model))""",
    """CREATE TABLE IF NOT EXISTS weight_errors (
    owner TEXT NOT NULL, model TEXT NOT NULL, seq BIGINT NOT NULL, error TEXT NOT NULL,
    PRIMARY KEY (owner, seq))""",
)
_LEASES = (
    # a store's lease: live while expires_at (database clock) is ahead; holder is JSON {pid, host, since}
    """CREATE TABLE leases (
    owner TEXT PRIMARY KEY, exclusive INTEGER NOT NULL, holder TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL)""",
    # named locks among the stores (the fleet's weight-sync lock); a gone holder's lock is free
    "CREATE TABLE locks (name TEXT PRIMARY KEY, owner TEXT NOT NULL)",
    # a job's uploaded input (input_reference), so a queued job with one runs again after a restart
    "CREATE TABLE uploads (job_id TEXT PRIMARY KEY, data {blob} NOT NULL)",
    "ALTER TABLE jobs ADD COLUMN bytes BIGINT",  # its artifact's size (retention's cap)
    "CREATE INDEX jobs_status ON jobs (status)",
)


def _v1(db: Database) -> None:
    """The jobs and weight-sync tables; an older SQLite jobs table gains the columns added since."""
    db.execute(_JOBS.format(serial=db.serial))
    present = db.columns("jobs")
    for column in ("request", "request_id", "owner"):
        if column not in present:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {column} TEXT")
    for table in _WEIGHTS:
        db.execute(table.format(serial=db.serial))


def _v2(db: Database) -> None:
    """Leases instead of lock files, named locks, kept uploads, artifact sizes."""
    for statement in _LEASES:
        db.execute(statement.format(blob=db.blob))


MIGRATIONS: tuple[Callable[[Database], None], ...] = (_v1, _v2)
VERSION = len(MIGRATIONS)


def migrate(db: Database) -> int:
    """Bring ``db`` to ``VERSION``; returns the version it was at."""
    with db.transaction():
        if db.postgres:  # one migrator at a time (SQLite's BEGIN IMMEDIATE already is)
            db.execute("SELECT pg_advisory_xact_lock(7246)")
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = db.execute("SELECT version FROM schema_version").fetchone()
        found = row[0] if row else 0
        if found > VERSION:
            raise ConfigError(
                f"the job store at {db.where} has schema version {found}, newer than this fv's {VERSION}: "
                "a newer fv wrote it. Fix: upgrade fv here (every replica of a fleet runs the same fv), "
                "or point this server at another store (the deploy's store / data_dir)."
            )
        for step in MIGRATIONS[found:]:
            step(db)
        if row is None:
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (VERSION,))
        elif found != VERSION:
            db.execute("UPDATE schema_version SET version=?", (VERSION,))
    return found
