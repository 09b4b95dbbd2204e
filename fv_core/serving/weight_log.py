"""Weight syncs shared by a fleet: every replica on one job store applies every sync, in one order.

A fleet (replicas on one job store, ``JobStore`` shared mode) takes a trainer's push on whichever
replica the proxy picks. Under the fleet's sync lock (a row in the store's ``locks``: one push at a
time in the fleet, freed when its holder's lease is gone) that replica first applies every logged
sync it lacks, so it checks the push against the fleet's weights; then it writes the payload under
``weights/`` of the artifact storage, logs a pending row in ``weight_syncs``, puts the sync live
itself and settles the row (or withdraws it, when that failed). The other replicas apply settled
rows only, oldest first, each at a step boundary of its own engine, and record how far they got in
``weight_applied``; a replica that starts later applies the whole log before it takes jobs. So every
replica runs the same sequence of weights.

A sync's version must be new to the fleet (never logged nor loaded before for that component): no
replica can then hold it, live or retired, and the version check cannot pass on one replica and
fail on another. ``compact`` drops a sync every live replica has applied whose every tensor later syncs
(applied by all of them too) replace, row and file: a replica starting later ends on the same
weights by applying the later ones alone, and does so before it takes jobs.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fv_core.errors import ConfigError

if TYPE_CHECKING:
    from fv_core.serving.jobs import JobStore

LOCK_POLL_S = 0.05  # how often a push waiting for the fleet's sync lock tries again


@dataclass(frozen=True, slots=True)
class LoggedSync:
    seq: int  # its place in the fleet's order
    model: str  # served model name
    plan: str  # the WeightSyncPlan as JSON
    path: (
        Path  # the payload (safetensors) on this node; on a bucket, there once ``WeightLog.read`` fetched it
    )


def tensor_names(payload: bytes) -> dict[str, list[str]]:
    """Component -> the tensor names a sync payload (safetensors, ``"<component>.<name>"`` keys) holds,
    read from its header alone."""
    size = int.from_bytes(payload[:8], "little")
    names: dict[str, list[str]] = {}
    for key in json.loads(payload[8 : 8 + size]):
        if key != "__metadata__":
            component, _, name = key.partition(".")
            names.setdefault(component, []).append(name)
    return names


class WeightLog:
    """The fleet's weight syncs, on a shared ``JobStore``'s database and data dir."""

    def __init__(self, store: JobStore) -> None:
        self.owner, self.gone, self.db, self.storage = store.me, store.gone, store.db, store.storage
        shared = self.storage.local("weights/")
        self.remote = shared is None  # a bucket: payloads are uploaded, and read through a local copy
        self.folder = store.root / "weights" if shared is None else shared
        self.folder.mkdir(parents=True, exist_ok=True)

    @asynccontextmanager
    async def lock(self) -> AsyncIterator[None]:
        """The fleet's sync lock (a row in the store's ``locks``; a gone holder's is free), polled so a
        cancelled push never leaves it held."""
        while not self._take_lock():
            await asyncio.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            self.db.execute("DELETE FROM locks WHERE name='weights' AND owner=?", (self.owner,))

    def _take_lock(self) -> bool:
        taken = "INSERT INTO locks (name, owner) VALUES ('weights', ?) ON CONFLICT DO NOTHING"
        if self.db.execute(taken, (self.owner,)).rowcount:
            return True
        row = self.db.execute("SELECT owner FROM locks WHERE name='weights'").fetchone()
        if row is not None and self.gone(row[0]):  # its holder stopped mid-push: free it
            self.db.execute("DELETE FROM locks WHERE name='weights' AND owner=?", (row[0],))
        return False

    def check_new(self, model: str, components: list[str], version: str) -> None:
        """Refuse a version the fleet has logged before for one of ``components`` (under the lock)."""
        for component in components:
            row = self.db.execute(
                "SELECT 1 FROM weight_versions WHERE model=? AND component=? AND version=?",
                (model, component, version),
            ).fetchone()
            if row:
                raise ConfigError(
                    f"version {version!r} of {component!r} was synced to (or loaded by) this fleet before; "
                    "replicas may still hold it for running requests, and cached features are keyed by it. "
                    "Fix: give these weights a new version.",
                    param="version",
                )

    def write(self, payload: bytes) -> Path:
        """Store a payload under ``weights/`` (whole or not at all: readers never see half a file); on a
        bucket, uploaded too."""
        path = self.folder / f"{uuid.uuid4().hex}.safetensors"
        partial = path.with_suffix(".partial")
        try:
            partial.write_bytes(payload)
            partial.rename(path)
        finally:
            partial.unlink(missing_ok=True)
        if self.remote:
            self.storage.put_bytes(f"weights/{path.name}", payload)
        return path

    def _remove(self, file: str) -> None:
        (self.folder / file).unlink(missing_ok=True)
        if self.remote:
            self.storage.delete(f"weights/{file}")

    def _local(self, file: str) -> Path:
        """A logged payload on this node (on a bucket: downloaded once; a missing one stays missing)."""
        path = self.folder / file
        if self.remote and not path.exists():
            try:
                data = self.storage.read(f"weights/{file}")
            except FileNotFoundError:
                return path
            path.with_suffix(".partial").write_bytes(data)
            path.with_suffix(".partial").rename(path)
        return path

    def publish(self, model: str, plan_json: str, path: Path, tensors: dict[str, list[str]]) -> LoggedSync:
        """Log a checked sync, its payload at ``path``, as pending (under the lock); the caller puts it
        live, then ``settle``s or ``withdraw``s it. A pending row left by a receiver that died goes first."""
        try:
            stale = self.db.execute("SELECT file FROM weight_syncs WHERE settled=0").fetchall()
            self.db.execute("DELETE FROM weight_syncs WHERE settled=0")
            seq = self.db.execute(
                "INSERT INTO weight_syncs (model, plan, tensors, file) VALUES (?, ?, ?, ?) RETURNING seq",
                (model, plan_json, json.dumps(tensors), path.name),
            ).fetchone()[0]
        except BaseException:
            self._remove(path.name)
            raise
        for (file,) in stale:
            self._remove(file)
        return LoggedSync(int(seq), model, plan_json, path)

    def taken(self, model: str, versions: dict[str, str]) -> None:
        """Record ``versions`` (component -> version) as used: a push may never reuse them."""
        self.db.executemany(
            "INSERT INTO weight_versions (model, component, version) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            [(model, component, version) for component, version in versions.items()],
        )

    def settle(self, sync: LoggedSync, versions: dict[str, str]) -> None:
        """``sync`` is live on its receiver: every replica applies it now, and its versions are taken."""
        with self.db.transaction():
            self.db.execute("UPDATE weight_syncs SET settled=1 WHERE seq=?", (sync.seq,))
            self.taken(sync.model, versions)

    def withdraw(self, sync: LoggedSync) -> None:
        """``sync`` failed on its receiver: no replica applies it."""
        self.db.execute("DELETE FROM weight_syncs WHERE seq=?", (sync.seq,))
        self._remove(sync.path.name)

    def after(self, seq: int, models: list[str]) -> list[LoggedSync]:
        """The settled syncs of ``models`` after ``seq``, oldest first."""
        rows = self.db.execute(
            "SELECT seq, model, plan, file FROM weight_syncs WHERE seq > ? AND settled=1 ORDER BY seq", (seq,)
        ).fetchall()
        return [LoggedSync(s, m, p, self.folder / f) for s, m, p, f in rows if m in models]

    def read(self, sync: LoggedSync) -> bytes:
        """A logged sync's payload (on a bucket: downloaded once to this node; off the event loop)."""
        return self._local(sync.path.name).read_bytes()

    def applied(self, model: str, seq: int) -> None:
        """Record that this replica has applied ``model``'s syncs up to ``seq`` (its earlier errors go)."""
        self.db.execute(
            "INSERT INTO weight_applied (owner, model, seq) VALUES (?, ?, ?) "
            "ON CONFLICT (owner, model) DO UPDATE SET seq=excluded.seq",
            (self.owner, model, seq),
        )
        self.db.execute("DELETE FROM weight_errors WHERE owner=? AND seq<=?", (self.owner, seq))

    def failed(self, sync: LoggedSync, error: str) -> None:
        """Record that ``sync`` failed on this replica (it stays behind and tries again)."""
        self.db.execute(
            "INSERT INTO weight_errors (owner, model, seq, error) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (owner, seq) DO UPDATE SET model=excluded.model, error=excluded.error",
            (self.owner, sync.model, sync.seq, error[:2000]),
        )

    def behind(self, model: str, seq: int) -> list[str]:
        """The live replicas serving ``model`` that have not applied up to ``seq`` yet."""
        return sorted(owner for owner, applied in self._live(model).items() if applied < seq)

    def failures(self, model: str, seq: int) -> dict[str, str]:
        """Live replica -> the last error it met applying a sync of ``model`` up to ``seq`` (and has not
        got past)."""
        live = self._live(model)
        rows = self.db.execute(
            "SELECT owner, error FROM weight_errors WHERE model=? AND seq<=? ORDER BY seq", (model, seq)
        )
        return {owner: error for owner, error in rows.fetchall() if owner in live}

    def compact(self, model: str) -> None:
        """Drop the syncs of ``model`` that every live replica applied and whose every tensor later
        syncs, applied by all of them too, replace."""
        floor = min(self._live(model).values(), default=0)
        rows = self.db.execute(
            "SELECT seq, tensors, file FROM weight_syncs WHERE model=? AND settled=1 AND seq<=? "
            "ORDER BY seq DESC",
            (model, floor),
        ).fetchall()
        later: dict[str, set[str]] = {}  # component -> tensors the newer syncs replace
        dropped: list[tuple[int, str]] = []
        for seq, tensors, file in rows:
            names = {component: set(keys) for component, keys in json.loads(tensors).items()}
            if later and all(keys <= later.get(component, set()) for component, keys in names.items()):
                dropped.append((seq, file))
            for component, keys in names.items():
                later.setdefault(component, set()).update(keys)
        if not dropped:
            return
        with self.db.transaction():
            self.db.executemany("DELETE FROM weight_syncs WHERE seq=?", [(seq,) for seq, _ in dropped])
        for _, file in dropped:
            self._remove(file)

    def _live(self, model: str) -> dict[str, int]:
        """Live replica serving ``model`` -> how far it applied the log."""
        rows = self.db.execute("SELECT owner, seq FROM weight_applied WHERE model=?", (model,)).fetchall()
        return {owner: seq for owner, seq in rows if not self.gone(owner)}
