"""Durable jobs: a SQLite job table and one mp4 per completed video in the data directory.

Ids are ``video_`` + 32 hex digits; an id that does not match never reaches
the filesystem, and artifact paths are built by the store, never taken from
the caller. On open, jobs left in progress by a process that stopped are
marked failed with the reason; queued jobs whose request was kept run again.

Shared mode (``owner=`` a replica id; the Ray Serve fleet, ``fv-ray-serve``): several servers
open one data dir at once. Each row records the replica that owns it, and each replica holds an
exclusive flock on ``owners/<owner>.lock`` for its life, so "is the owner alive?" is "can I take
its lock?" (the OS releases it when the process dies, however it dies). A replica recovers only
jobs of owners that are gone, never a live replica's. A job deleted through any replica loses its
row; its owner sees the row gone (``missing``) and cancels the job at the next step boundary.

Where shared mode is safe: SQLite's WAL keeps its index in shared memory, so every replica must
run on the one host that holds the data dir (any number of processes there). Across machines WAL
does not work even on storage whose POSIX locks work (NFS): that needs the job table in a database
server (Postgres, say) and the videos folder on shared storage — not built here.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

from fv_core.errors import ConfigError
from fv_core.serving.schemas import JobError, Video

ID_PATTERN = re.compile(r"^video_[0-9a-f]{32}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    size TEXT NOT NULL,
    seconds TEXT NOT NULL,
    prompt TEXT,
    error_code TEXT,
    error_message TEXT,
    request TEXT,
    request_id TEXT,
    owner TEXT
)
"""
_ADDED_COLUMNS = ("request", "request_id", "owner")  # data dirs from before them gain them on open
_UNFINISHED = "status IN ('queued','in_progress')"
_COLUMNS = (
    "id, model, status, progress, created_at, completed_at, size, seconds, prompt, error_code, error_message"
)


def new_job_id() -> str:
    return f"video_{uuid.uuid4().hex}"


def default_data_dir() -> Path:
    """``$FV_DATA_DIR``, else ``$XDG_DATA_HOME/fv``, else ``~/.local/share/fv`` (never the working directory)."""
    if os.environ.get("FV_DATA_DIR"):
        return Path(os.environ["FV_DATA_DIR"])
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "fv"


class JobStore:
    """The job table and artifact folder; used from the event loop thread only.

    A lone store (``owner=None``) holds an exclusive lock on its folder for its life (released by the
    OS when the process dies, so a crashed server leaves no stale lock): a second server on the same
    data dir refuses to start instead of failing the first one's jobs. A shared store (``owner`` set)
    holds that lock shared, so replicas coexist with each other but never with a lone server."""

    def __init__(self, data_dir: str | Path, max_age_s: int | None = None, owner: str | None = None) -> None:
        self.root = Path(data_dir).resolve()
        self.max_age_s = max_age_s  # a finished job expires this long after it ended (None: never)
        self.owner = owner  # this replica's id in shared mode; None: the only server on the dir
        self.videos = self.root / "videos"
        self.videos.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock()
        self._owner_lock = self._take_owner_lock() if owner is not None else None
        self.db = sqlite3.connect(
            self.root / "jobs.sqlite3", isolation_level=None, check_same_thread=False, timeout=30
        )
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(_SCHEMA)
        present = {row[1] for row in self.db.execute("PRAGMA table_info(jobs)")}
        for column in _ADDED_COLUMNS:
            if column not in present:
                self.db.execute(f"ALTER TABLE jobs ADD COLUMN {column} TEXT")
        self.recovered = self.recover()

    @property
    def shared(self) -> bool:
        return self.owner is not None

    def close(self) -> None:
        self.db.close()
        if self._owner_lock is not None:
            self._owner_lock.close()
        self._lock.close()  # releases the flock

    def _take_lock(self) -> Any:
        path = self.root / "server.lock"
        handle = path.open("a+")
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a fleet of replicas (shared mode)"
            handle.close()
            raise ConfigError(
                f"data dir {str(self.root)!r} is in use by {holder}. Fix: stop that server, or give this one "
                "another data dir (--data-dir or the deploy's data_dir)."
            ) from None
        if not self.shared:
            handle.seek(0)
            handle.truncate()
            handle.write(
                json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": int(time.time())})
            )
            handle.flush()
        return handle

    def _owner_path(self, owner: str) -> Path:
        return self.root / "owners" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', owner)}.lock"

    def _take_owner_lock(self) -> Any:
        """This replica's liveness lock: held exclusively until the store closes or the process dies."""
        path = self._owner_path(self.owner or "")
        path.parent.mkdir(exist_ok=True)
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ConfigError(
                f"replica id {self.owner!r} is already in use on {str(self.root)!r}. Fix: give each replica "
                "its own id."
            ) from None
        return handle

    def gone(self, owner: str) -> bool:
        """Whether a job owner has stopped: its lock file can be locked (or is gone)."""
        if owner == self.owner:
            return False
        path = self._owner_path(owner)
        if not path.exists():
            return True
        with path.open("a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its process holds the lock: alive
            path.unlink(missing_ok=True)  # a gone owner's file; ids are never reused
            return True

    def recover(self) -> int:
        """Fail the jobs a stopped process left unfinished, except queued ones that can run again
        (their request was kept: ``claim_queued`` hands them out); returns how many failed.

        A lone store recovers every unfinished job (no other server can be running); a shared store
        only those of owners that are gone."""
        where, args = "1", ()
        if self.shared:  # unowned rows (left by a lone server, or already orphaned) and gone owners'
            owners = [r[0] for r in self.db.execute(f"SELECT DISTINCT owner FROM jobs WHERE {_UNFINISHED}")]
            gone = tuple(o for o in owners if o is not None and self.gone(o))
            where, args = f"owner IS NULL OR owner IN ({','.join('?' * len(gone))})", gone
        cur = self.db.execute(
            "UPDATE jobs SET status='failed', error_code='server_restart', error_message="
            "'the server stopped while this job was ' || status || '; submit it again' "
            f"WHERE ({where}) AND (status='in_progress' OR (status='queued' AND request IS NULL))",
            args,
        )
        self.db.execute(f"UPDATE jobs SET owner=NULL WHERE ({where}) AND status='queued'", args)
        return cur.rowcount

    def claim_queued(self, models: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, model, request) of the queued jobs with a kept request this store should run, oldest
        first: a lone store, all of them; a shared store, the unowned ones of ``models`` (those it
        serves), each claimed atomically so no two replicas run one job."""
        rows = self.db.execute(
            "SELECT id, model, request FROM jobs WHERE status='queued' AND request IS NOT NULL "
            + ("AND owner IS NULL " if self.shared else "")
            + "ORDER BY seq"
        ).fetchall()
        if self.shared:
            claim = "UPDATE jobs SET owner=? WHERE id=? AND owner IS NULL AND status='queued'"
            rows = [r for r in rows if r[1] in models and self.db.execute(claim, (self.owner, r[0])).rowcount]
        return [(job_id, model, json.loads(request)) for job_id, model, request in rows]

    def queued(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, model, request) of each queued job with a kept request, oldest first."""
        rows = self.db.execute(
            "SELECT id, model, request FROM jobs WHERE status='queued' AND request IS NOT NULL ORDER BY seq"
        ).fetchall()
        return [(job_id, model, json.loads(request)) for job_id, model, request in rows]

    def missing(self, job_ids: list[str]) -> list[str]:
        """The ids among ``job_ids`` that have no row (deleted, possibly through another replica)."""
        if not job_ids:
            return []
        marks = ",".join("?" * len(job_ids))
        found = {r[0] for r in self.db.execute(f"SELECT id FROM jobs WHERE id IN ({marks})", job_ids)}
        return [j for j in job_ids if j not in found]

    def request_id(self, job_id: str) -> str | None:
        """The ``x-request-id`` of the HTTP request that created the job."""
        row = self.db.execute("SELECT request_id FROM jobs WHERE id=?", (job_id,)).fetchone()
        return row[0] if row else None

    def is_requeueable(self, job_id: str) -> bool:
        """Whether a job never started and can run again after a restart."""
        row = self.db.execute(
            "SELECT 1 FROM jobs WHERE id=? AND status='queued' AND request IS NOT NULL", (job_id,)
        ).fetchone()
        return row is not None

    # -- writes ---------------------------------------------------------------------------------------

    def create(
        self,
        job_id: str,
        model: str,
        size: str,
        seconds: str,
        prompt: str,
        request: dict | None = None,
        request_id: str | None = None,
    ) -> Video:
        """A queued job; ``request`` (JSON-able) lets a restarted server run it if it never started;
        ``request_id`` is the HTTP request's ``x-request-id``."""
        now = int(time.time())
        kept = json.dumps(request) if request else None
        self.db.execute(
            "INSERT INTO jobs (id, model, status, created_at, size, seconds, prompt, request, request_id, owner) "
            "VALUES (?,?,?,?,?,?,?,?,?,?)",
            (job_id, model, "queued", now, size, seconds, prompt, kept, request_id, self.owner),
        )
        return Video(
            id=job_id,
            model=model,
            status="queued",
            progress=0,
            created_at=now,
            size=size,
            seconds=seconds,
            prompt=prompt,
        )

    def progress(self, job_id: str, progress: int) -> None:
        self.db.execute(
            "UPDATE jobs SET status='in_progress', progress=? WHERE id=? AND status IN ('queued','in_progress')",
            (progress, job_id),
        )

    def complete(self, job_id: str, size: str, seconds: str) -> bool:
        """Mark completed; False when the job was deleted meanwhile."""
        cur = self.db.execute(
            "UPDATE jobs SET status='completed', progress=100, completed_at=?, size=?, seconds=? "
            "WHERE id=? AND status IN ('queued','in_progress')",
            (int(time.time()), size, seconds, job_id),
        )
        return cur.rowcount == 1

    def fail(self, job_id: str, code: str, message: str) -> None:
        self.db.execute(
            "UPDATE jobs SET status='failed', completed_at=?, error_code=?, error_message=? WHERE id=?",
            (int(time.time()), code, message, job_id),
        )

    def delete(self, job_id: str) -> bool:
        """Remove the row and its artifact; False when there was no such job."""
        if not ID_PATTERN.match(job_id):
            return False
        cur = self.db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
        self.video_path(job_id).unlink(missing_ok=True)
        self.video_path(job_id).with_suffix(".json").unlink(missing_ok=True)  # its provenance
        return cur.rowcount == 1

    def sweep(self, max_bytes: int | None = None, now: int | None = None) -> list[str]:
        """Delete expired finished jobs, then the oldest finished ones while the videos folder holds more
        than ``max_bytes``; returns the ids deleted."""
        now = int(time.time()) if now is None else now
        deadline = now - self.max_age_s if self.max_age_s is not None else -1  # ended at or before: expired
        finished = "FROM jobs WHERE status IN ('completed','failed')"
        ended = "COALESCE(completed_at, created_at)"
        deleted = [r[0] for r in self.db.execute(f"SELECT id {finished} AND {ended} <= ?", (deadline,))]
        for job_id in deleted:
            self.delete(job_id)
        if max_bytes is None:
            return deleted
        size = sum(p.stat().st_size for p in self.videos.iterdir() if p.is_file())
        for (job_id,) in self.db.execute(f"SELECT id {finished} ORDER BY {ended}").fetchall():  # oldest first
            if size <= max_bytes:
                break
            files = (self.video_path(job_id), self.video_path(job_id).with_suffix(".json"))
            size -= sum(f.stat().st_size for f in files if f.is_file())
            self.delete(job_id)
            deleted.append(job_id)
        return deleted

    # -- reads ----------------------------------------------------------------------------------------

    def get(self, job_id: str) -> Video | None:
        if not ID_PATTERN.match(job_id):
            return None
        row = self.db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id=?", (job_id,)).fetchone()
        return self._video(row) if row else None

    def list(self, after: str | None, limit: int, order: str) -> tuple[list[Video], bool]:
        """A page of jobs by creation order, and whether more follow."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where = f"WHERE seq {op} (SELECT seq FROM jobs WHERE id=?)" if after is not None else ""
        args: tuple[Any, ...] = (after, limit + 1) if after is not None else (limit + 1,)
        query = f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY seq {direction} LIMIT ?"
        rows = self.db.execute(query, args).fetchall()
        return [self._video(r) for r in rows[:limit]], len(rows) > limit

    def video_path(self, job_id: str) -> Path:
        """Where a job's mp4 lives; only for ids that match ID_PATTERN."""
        if not ID_PATTERN.match(job_id):
            raise ValueError(f"not a video id: {job_id!r}")
        return self.videos / f"{job_id}.mp4"

    def artifact(self, job_id: str) -> Path | None:
        """The mp4 of a completed job, if it exists."""
        job = self.get(job_id)
        if job is None or job.status != "completed":
            return None
        path = self.video_path(job_id)
        return path if path.is_file() else None

    def _video(self, row: tuple) -> Video:
        video = _video(row)
        if video.completed_at is not None and self.max_age_s is not None:
            video.expires_at = video.completed_at + self.max_age_s
        return video


def _video(row: tuple) -> Video:
    (job_id, model, status, progress, created, completed, size, seconds, prompt, code, message) = row
    error = JobError(code=code, message=message) if code else None
    return Video(
        id=job_id,
        model=model,
        status=status,
        progress=progress,
        created_at=created,
        completed_at=completed,
        size=size,
        seconds=seconds,
        prompt=prompt,
        error=error,
    )
