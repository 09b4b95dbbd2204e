"""Leases: who is alive among the stores on one job database.

Each open store holds a row in ``leases``: its owner id, whether it is a lone server (exclusive: no
other store may open the database meanwhile), its holder (pid, host, since) and an expiry that a
heartbeat thread pushes ahead every third of ``lease_s``. Expiry is read and written in the
database's clock, so clock skew between hosts changes nothing. An owner is gone when its row is gone
or expired, or, on the same host, when its process is dead (a crashed server restarts at once
instead of waiting for its lease to run out). A replica that misses its heartbeats long enough is
taken for gone; the store fences it: its writes name the owner, so they no longer touch jobs that
others recovered (and its watcher cancels them).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from fv_core.errors import ConfigError
from fv_core.serving.store.db import Database

log = logging.getLogger("fv.serving")
LEASE_S = 10.0  # a store that has not renewed its lease for this long is taken for gone


def _host() -> str:
    """This host (and boot): pids are compared only between stores on the same one."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Lease:
    """This store's lease row, renewed in the background on a connection of its own."""

    def __init__(self, db: Database, owner: str, exclusive: bool, lease_s: float = LEASE_S) -> None:
        self.db, self.owner, self.lease_s = db, owner, lease_s
        self.holder = {"pid": os.getpid(), "host": _host(), "since": int(time.time())}
        self.lost = False  # the heartbeat found this lease taken for gone (its jobs were recovered)
        with db.transaction():
            live = {}
            for owner_, excl, holder in db.execute("SELECT owner, exclusive, holder FROM leases").fetchall():
                if not self.gone(owner_):
                    live[owner_] = (excl, holder)
            self._check(live, exclusive)
            db.execute(
                f"INSERT INTO leases (owner, exclusive, holder, expires_at) VALUES (?, ?, ?, {db.now} + ?)",
                (owner, int(exclusive), json.dumps(self.holder), lease_s),
            )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name=f"fv-lease-{owner}", daemon=True)
        self._thread.start()

    def _check(self, live: dict[str, tuple[int, str]], exclusive: bool) -> None:
        lone = [holder for excl, holder in live.values() if excl]
        if lone or (exclusive and live):
            holder = lone[0] if lone else "a fleet of replicas (shared mode)"
            raise ConfigError(
                f"{self.db.where} is in use by {holder}. Fix: stop that server, or give this one "
                "another store (--data-dir, or the deploy's data_dir / store)."
            )
        if self.owner in live:
            raise ConfigError(
                f"replica id {self.owner!r} is already in use on {self.db.where}. Fix: give each replica "
                "its own id."
            )

    def gone(self, owner: str) -> bool:
        """Whether ``owner`` has stopped: no lease, an expired one, or a dead process on this host.
        A gone owner's row is removed (owner ids are never reused)."""
        if owner == self.owner:
            return False
        row = self.db.execute(
            f"SELECT holder, expires_at < {self.db.now} FROM leases WHERE owner=?", (owner,)
        ).fetchone()
        if row is None:
            return True
        holder = json.loads(row[0])
        if not row[1] and not (holder.get("host") == _host() and _dead(int(holder.get("pid", 0)))):
            return False
        self.db.execute("DELETE FROM leases WHERE owner=?", (owner,))
        return True

    def _heartbeat(self) -> None:
        db = Database(self.db.url)  # its own connection: renewals never wait on the event loop
        try:
            while not self._stop.wait(self.lease_s / 3):
                try:
                    renewed = db.execute(
                        f"UPDATE leases SET expires_at = {db.now} + ? WHERE owner=?",
                        (self.lease_s, self.owner),
                    ).rowcount
                    if not renewed and not self.lost:
                        self.lost = True
                        log.error(
                            "replica %s missed its lease; its jobs went to other replicas, and it fences "
                            "itself off them", self.owner,
                        )  # fmt: skip
                        db.execute(
                            f"INSERT INTO leases (owner, exclusive, holder, expires_at) "
                            f"VALUES (?, 0, ?, {db.now} + ?)",
                            (self.owner, json.dumps(self.holder), self.lease_s),
                        )
                except Exception:  # a busy or unreachable database: try again next beat
                    log.exception("renewing the lease of %s failed", self.owner)
        finally:
            db.close()

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.db.execute("DELETE FROM leases WHERE owner=?", (self.owner,))
