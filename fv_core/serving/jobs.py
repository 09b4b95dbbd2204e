"""Durable jobs: a job table (SQLite in the data dir, or PostgreSQL for a fleet across hosts) and one
mp4 per completed video in the artifact storage (the data dir, a shared folder, or an S3 bucket).

Ids are ``video_`` + 32 hex digits; an id that does not match never reaches the storage, and
artifact keys are built by the store, never taken from the caller. On open, the schema migrates
(``store.migrations``), jobs left in progress by a store that stopped are marked failed with the
reason, and queued jobs whose request (and upload) was kept run again.

Every store holds a lease (``store.leases``) and every job row names the store that owns it. A lone
server (``owner=None``) holds an exclusive lease: a second server on its store refuses to start. A
fleet replica (``owner=`` its id; ``fv-ray-serve``) holds a shared one, so replicas coexist, on one
host (SQLite in WAL mode) or on many (PostgreSQL, with the artifacts on storage every node reaches).
A replica recovers only jobs of owners that are gone, never a live one's: running jobs fail
(``server_restart``), queued ones are claimed by exactly one live replica. A job deleted through any
replica loses its row; its owner sees it ``lost`` and cancels it at the next step boundary. Writes
name the owner, so a replica taken for gone (it missed its lease) never overwrites a job another
replica took over.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from fv_core.serving.schemas import JobError, Video
from fv_core.serving.store.db import Database
from fv_core.serving.store.leases import LEASE_S, Lease
from fv_core.serving.store.migrations import migrate
from fv_core.serving.store.storage import Storage, open_storage

ID_PATTERN = re.compile(r"^video_[0-9a-f]{32}$")
LINK_S = 3600  # presigned download links (S3) are good for this long
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
    """The job table and artifact storage; used from the event loop thread only.

    ``store``: the database URL (``sqlite:///path`` or ``postgresql://...``; default: SQLite in
    ``data_dir``); ``artifacts``: the storage URL (default: ``data_dir``). ``data_dir`` is this
    node's own folder (the SQLite file, staged uploads to a bucket)."""

    def __init__(
        self,
        data_dir: str | Path,
        max_age_s: int | None = None,
        owner: str | None = None,
        store: str | None = None,
        artifacts: str | None = None,
        lease_s: float = LEASE_S,
    ) -> None:
        self.root = Path(data_dir).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_age_s = max_age_s  # a finished job expires this long after it ended (None: never)
        self.owner = owner  # this replica's id in shared mode; None: the only server on the store
        self.me = owner or f"server-{uuid.uuid4().hex[:12]}"  # the id its rows and lease carry
        self.db = Database(store or f"sqlite://{self.root / 'jobs.sqlite3'}")
        try:
            self.migrated_from = migrate(self.db)
            self.lease = Lease(self.db, self.me, exclusive=owner is None, lease_s=lease_s)
        except BaseException:
            self.db.close()
            raise
        self.storage: Storage = open_storage(artifacts, self.root)
        self._progress: dict[str, int] = {}  # job id -> the percent last written, while it runs
        self.videos = self.storage.staging("videos/.keep").parent
        self.recovered = self.recover()

    @property
    def shared(self) -> bool:
        return self.owner is not None

    def close(self) -> None:
        self.lease.release()
        self.db.close()

    def gone(self, owner: str) -> bool:
        """Whether a job owner has stopped (its lease is gone or expired)."""
        return self.lease.gone(owner)

    def recover(self) -> int:
        """Fail the jobs stopped stores left unfinished, except queued ones that can run again (their
        request was kept: ``claim_queued`` hands them out); returns how many failed."""
        owners = [r[0] for r in self.db.execute(f"SELECT DISTINCT owner FROM jobs WHERE {_UNFINISHED}")]
        gone = [o for o in owners if o is not None and self.gone(o)]
        where = f"owner IS NULL OR owner IN ({','.join('?' * len(gone)) or 'NULL'})"
        with self.db.transaction():
            cur = self.db.execute(
                "UPDATE jobs SET status='failed', error_code='server_restart', error_message="
                "'the server stopped while this job was ' || status || '; submit it again' "
                f"WHERE ({where}) AND (status='in_progress' OR (status='queued' AND request IS NULL))",
                gone,
            )
            self.db.execute(f"UPDATE jobs SET owner=NULL WHERE ({where}) AND status='queued'", gone)
        return int(cur.rowcount)

    def claim_queued(self, models: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, model, request) of the unowned queued jobs with a kept request this store runs now, oldest
        first, each claimed by exactly one store: a lone store, all of them; a replica, those of
        ``models`` (the ones it serves)."""
        pick = "status='queued' AND request IS NOT NULL AND owner IS NULL"
        args: list[Any] = [self.me]
        if self.shared:
            pick += f" AND model IN ({','.join('?' * len(models)) or 'NULL'})"
            args += models
        rows = self.db.execute(
            f"UPDATE jobs SET owner=? WHERE owner IS NULL AND id IN "
            f"(SELECT id FROM jobs WHERE {pick} ORDER BY seq{self.db.skip_locked}) RETURNING seq, id, model, request",
            args,
        ).fetchall()
        return [(job_id, model, json.loads(request)) for _, job_id, model, request in sorted(rows)]

    def queued(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, model, request) of each queued job with a kept request, oldest first."""
        rows = self.db.execute(
            "SELECT id, model, request FROM jobs WHERE status='queued' AND request IS NOT NULL ORDER BY seq"
        ).fetchall()
        return [(job_id, model, json.loads(request)) for job_id, model, request in rows]

    def lost(self, job_ids: list[str]) -> list[str]:
        """The ids among this store's running ``job_ids`` it must stop: deleted (possibly through another
        replica), or recovered by another replica (this one missed its lease)."""
        if not job_ids:
            return []
        marks = ",".join("?" * len(job_ids))
        mine = self.db.execute(
            f"SELECT id FROM jobs WHERE id IN ({marks}) AND owner=? AND {_UNFINISHED}", [*job_ids, self.me]
        )
        found = {r[0] for r in mine.fetchall()}
        return [j for j in job_ids if j not in found]

    def request_id(self, job_id: str) -> str | None:
        """The ``x-request-id`` of the HTTP request that created the job."""
        row = self.db.execute("SELECT request_id FROM jobs WHERE id=?", (job_id,)).fetchone()
        return row[0] if row else None

    def upload(self, job_id: str) -> bytes | None:
        """The file uploaded with the job (``input_reference``), kept until the job is deleted."""
        row = self.db.execute("SELECT data FROM uploads WHERE job_id=?", (job_id,)).fetchone()
        return bytes(row[0]) if row else None

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
        upload: bytes | None = None,
    ) -> Video:
        """A queued job; ``request`` (JSON-able) lets a restarted server run it if it never started,
        with ``upload`` (its uploaded file, kept in the store); ``request_id`` is the HTTP request's
        ``x-request-id``."""
        now = int(time.time())
        kept = json.dumps(request) if request else None
        with self.db.transaction():
            self.db.execute(
                "INSERT INTO jobs (id, model, status, created_at, size, seconds, prompt, request, request_id, "
                "owner) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (job_id, model, "queued", now, size, seconds, prompt, kept, request_id, self.me),
            )
            if upload is not None:
                self.db.execute("INSERT INTO uploads (job_id, data) VALUES (?, ?)", (job_id, upload))
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
        """Record a step's progress when the percent changed; on PostgreSQL without waiting for the disk
        (a crash loses at most the last few percents, and the job fails or reruns anyway)."""
        if self._progress.get(job_id) == progress:
            return
        self._progress[job_id] = progress
        update = f"UPDATE jobs SET status='in_progress', progress=? WHERE id=? AND owner=? AND {_UNFINISHED}"
        if not self.db.postgres:
            self.db.execute(update, (progress, job_id, self.me))
            return
        with self.db.transaction():
            self.db.execute("SET LOCAL synchronous_commit TO OFF")
            self.db.execute(update, (progress, job_id, self.me))

    def publish(self, job_id: str) -> int:
        """Publish a job's staged files (``video_path``, ``stages_path``) to the storage; returns their
        bytes. Storage only, no database: a server runs it off its event loop (an upload to a slow
        bucket stalls nothing else), then ``complete``."""
        return sum(self.storage.put(key) for key in _keys(job_id) if self.storage.staging(key).is_file())

    def complete(self, job_id: str, size: str, seconds: str, nbytes: int | None = None) -> bool:
        """Mark the job completed, its files published (``nbytes``, from ``publish``; None: publish them
        now); False (and the files removed) when the job was deleted or taken over meanwhile."""
        self._progress.pop(job_id, None)
        nbytes = self.publish(job_id) if nbytes is None else nbytes
        cur = self.db.execute(
            "UPDATE jobs SET status='completed', progress=100, completed_at=?, size=?, seconds=?, bytes=? "
            f"WHERE id=? AND owner=? AND {_UNFINISHED}",
            (int(time.time()), size, seconds, nbytes, job_id, self.me),
        )
        if cur.rowcount != 1:
            for key in _keys(job_id):
                self.storage.delete(key)
        return bool(cur.rowcount == 1)

    def fail(self, job_id: str, code: str, message: str) -> None:
        self._progress.pop(job_id, None)
        self.db.execute(
            "UPDATE jobs SET status='failed', completed_at=?, error_code=?, error_message=? WHERE id=? AND owner=?",
            (int(time.time()), code, message, job_id, self.me),
        )

    def delete(self, job_id: str) -> bool:
        """Remove the row, its upload and its artifact; False when there was no such job."""
        if not ID_PATTERN.match(job_id):
            return False
        self._progress.pop(job_id, None)
        with self.db.transaction():
            cur = self.db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
            self.db.execute("DELETE FROM uploads WHERE job_id=?", (job_id,))
        for key in _keys(job_id):
            self.storage.delete(key)
        return bool(cur.rowcount == 1)

    def sweep(self, max_bytes: int | None = None, now: int | None = None) -> list[str]:
        """Delete expired finished jobs, then the oldest finished ones while their artifacts hold more
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
        rows = self.db.execute(f"SELECT id, bytes {finished} ORDER BY {ended}").fetchall()  # oldest first
        sizes = [(job_id, self._bytes(job_id) if n is None else n) for job_id, n in rows]
        size = sum(n for _, n in sizes)
        for job_id, n in sizes:
            if size <= max_bytes:
                break
            size -= n
            self.delete(job_id)
            deleted.append(job_id)
        return deleted

    def _bytes(self, job_id: str) -> int:
        """The artifact size of a job finished before sizes were recorded (now recorded)."""
        n = sum(self.storage.size(key) for key in _keys(job_id))
        self.db.execute("UPDATE jobs SET bytes=? WHERE id=?", (n, job_id))
        return n

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
        """Where a job's mp4 is written (its provenance JSON beside it); only for ids that match
        ID_PATTERN. On a folder backend that is where it stays; a bucket uploads it on ``complete``."""
        if not ID_PATTERN.match(job_id):
            raise ValueError(f"not a video id: {job_id!r}")
        return self.storage.staging(_keys(job_id)[0])

    def stages_path(self, job_id: str) -> Path:
        """Where a workflow job's stage artifacts are written (a zip) before ``complete`` publishes them."""
        if not ID_PATTERN.match(job_id):
            raise ValueError(f"not a video id: {job_id!r}")
        return self.storage.staging(_keys(job_id)[2])

    def artifact(self, job_id: str, stages: bool = False) -> str | None:
        """The storage key of a completed job's mp4 (``stages``: its workflow's stage artifacts), if it exists."""
        job = self.get(job_id)
        if job is None or job.status != "completed":
            return None
        key = _keys(job_id)[2 if stages else 0]
        return key if self.storage.exists(key) else None

    def _video(self, row: tuple) -> Video:
        video = _video(row)
        if video.completed_at is not None and self.max_age_s is not None:
            video.expires_at = video.completed_at + self.max_age_s
        if video.status == "completed":  # its files were published before the row said so
            video.download_url = self.storage.link(_keys(video.id)[0], LINK_S)  # signed here, no request
        return video


def _keys(job_id: str) -> tuple[str, str, str]:
    """A job's artifact keys: the mp4, its provenance JSON, then a workflow's stage artifacts (a zip, only
    for a workflow that keeps them)."""
    return f"videos/{job_id}.mp4", f"videos/{job_id}.json", f"videos/{job_id}.stages.zip"


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
