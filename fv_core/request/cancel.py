"""Cancel scopes: a thread-safe flag checked by the runtime at step boundaries."""

from __future__ import annotations

import threading

from fv_core.errors import Cancelled


class CancelScope:
    """Cancellation of one request; takes effect at the next step boundary."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def cancel(self, reason: str = "cancelled by caller") -> None:
        self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def raise_if_cancelled(self, request_id: str) -> None:
        if self._event.is_set():
            raise Cancelled(f"request {request_id!r} was cancelled: {self.reason}")
