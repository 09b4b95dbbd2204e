"""Weight syncs shared by a fleet: every replica on one data dir applies every sync, in one order.

A fleet (replicas on one shared data dir, ``JobStore`` shared mode) takes a trainer's push on
whichever replica the proxy picks. That replica checks it, writes the payload under
``weights/`` and appends a row to ``weight_syncs``; each replica (the receiver too) applies the
rows it has not applied yet, oldest first, at a step boundary of its own engine, and records how
far it got in ``weight_applied``. A replica that starts later applies the whole log before it
takes jobs, so every replica serves the same weights once it has caught up.

Once its receiver has applied it, a sync settles: if it failed there (a version clash), its row
goes, as it fails alike on every replica applying the same order; if it went live, the earlier
syncs of the model whose every tensor the settled ones replace are compacted away (row and file),
since applying the later rows alone ends on the same weights.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fv_core.serving.jobs import JobStore

_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS weight_syncs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    plan TEXT NOT NULL,
    tensors TEXT NOT NULL,
    file TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    owner TEXT,
    ok INTEGER
)
""",
    """
CREATE TABLE IF NOT EXISTS weight_applied (
    owner TEXT NOT NULL,
    model TEXT NOT NULL,
    seq INTEGER NOT NULL,
    error TEXT,
    PRIMARY KEY (owner, model)
)
""",
)


@dataclass(frozen=True, slots=True)
class LoggedSync:
    seq: int  # its place in the fleet's order
    model: str  # served model name
    plan: str  # the WeightSyncPlan as JSON
    path: Path  # the payload (safetensors)


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
        self.store, self.db = store, store.db
        self.folder = store.root / "weights"
        self.folder.mkdir(exist_ok=True)
        for table in _SCHEMA:
            self.db.execute(table)

    def publish(self, model: str, plan_json: str, payload: bytes, tensors: dict[str, list[str]]) -> int:
        """Append a checked sync (``tensors``: component -> its tensor names); returns its seq. The
        receiver then applies it in order with the others and ``settle``s it."""
        path = self.folder / f"{uuid.uuid4().hex}.safetensors"
        partial = path.with_suffix(".partial")
        partial.write_bytes(payload)
        partial.rename(path)  # readers never see half a file
        cur = self.db.execute(
            "INSERT INTO weight_syncs (model, plan, tensors, file, created_at, owner) VALUES (?, ?, ?, ?, ?, ?)",
            (model, plan_json, json.dumps(tensors), path.name, int(time.time()), self.store.owner),
        )
        return int(cur.lastrowid or 0)

    def settle(self, sync: LoggedSync, ok: bool) -> None:
        """The receiver applied ``sync``: keep it (and compact what it replaces) or withdraw it."""
        if not ok:
            self.db.execute("DELETE FROM weight_syncs WHERE seq=?", (sync.seq,))
            sync.path.unlink(missing_ok=True)
            return
        self.db.execute("UPDATE weight_syncs SET ok=1 WHERE seq=?", (sync.seq,))
        self._compact(sync.model)

    def after(self, seq: int, models: list[str]) -> list[LoggedSync]:
        """The syncs of ``models`` after ``seq``, oldest first."""
        rows = self.db.execute(
            "SELECT seq, model, plan, file FROM weight_syncs WHERE seq > ? ORDER BY seq", (seq,)
        ).fetchall()
        return [LoggedSync(s, m, p, self.folder / f) for s, m, p, f in rows if m in models]

    def applied(self, model: str, seq: int, error: str | None = None) -> None:
        """Record that this replica has applied ``model``'s syncs up to ``seq`` (``error``: the last failed)."""
        self.db.execute(
            "INSERT INTO weight_applied (owner, model, seq, error) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (owner, model) DO UPDATE SET seq=excluded.seq, error=excluded.error",
            (self.store.owner, model, seq, error),
        )

    def behind(self, model: str, seq: int) -> list[str]:
        """The live replicas serving ``model`` that have not applied up to ``seq`` yet."""
        rows = self.db.execute(
            "SELECT owner FROM weight_applied WHERE model=? AND seq<?", (model, seq)
        ).fetchall()
        return sorted(owner for (owner,) in rows if not self.store.gone(owner))

    def failures(self, model: str, seq: int) -> dict[str, str]:
        """Replica -> the error it met applying ``model``'s sync ``seq``."""
        rows = self.db.execute(
            "SELECT owner, error FROM weight_applied WHERE model=? AND seq=? AND error IS NOT NULL",
            (model, seq),
        ).fetchall()
        return dict(rows)

    def _compact(self, model: str) -> None:
        """Drop the syncs of ``model`` whose every tensor a later settled sync replaces."""
        rows = self.db.execute(
            "SELECT seq, tensors, file, ok FROM weight_syncs WHERE model=? ORDER BY seq DESC", (model,)
        ).fetchall()
        later: dict[str, set[str]] = {}  # component -> tensors the newer settled syncs replace
        for seq, tensors, file, ok in rows:
            names = {component: set(keys) for component, keys in json.loads(tensors).items()}
            if later and all(keys <= later.get(component, set()) for component, keys in names.items()):
                self.db.execute("DELETE FROM weight_syncs WHERE seq=?", (seq,))
                (self.folder / file).unlink(missing_ok=True)
            elif ok:
                for component, keys in names.items():
                    later.setdefault(component, set()).update(keys)
