"""Prefix sharing between requests that arrive together: the prefix cache serves only contexts already
prefilled, so requests that start alike and arrive in the same tick (8 chats with one system prompt)
would each prefill the shared prefix in the same call. Instead, a request whose context shares at least
a page more with a context still being prefilled (:class:`Prefilling`) than the cache holds waits for
it: its steps are idle (:func:`wait_plan`) until the cache holds that prefix (the other request's
prefill recorded it), then it starts from the cache and prefills only the rest. It stops waiting when the
other request leaves without recording it, and after ``MAX_WAITS`` idle steps (a policy that never runs
the other request's prefill meanwhile), and prefills its own.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any

from fv_core.kv import common_prefix_length
from fv_core.loop import WorkPlan, WorkUnitKind

MAX_WAITS = 8  # idle steps a request waits for another's prefill at most


class Prefilling:
    """Contexts whose prefill is running on one instance: request id -> (namespace, the context's keys)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._contexts: dict[str, tuple[Hashable, tuple]] = {}

    def add(self, request_id: str, namespace: Hashable, keys: Sequence[Hashable]) -> None:
        with self._lock:
            self._contexts[request_id] = (namespace, tuple(keys))

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._contexts.pop(request_id, None)

    def shared(self, request_id: str, namespace: Hashable, keys: Sequence[Hashable]) -> int:
        """The most leading tokens of ``keys`` another context being prefilled in ``namespace`` starts with."""
        with self._lock:
            others = [k for rid, (ns, k) in self._contexts.items() if rid != request_id and ns == namespace]
        return max((common_prefix_length(keys, other) for other in others), default=0)


def idle_body(inputs: dict[str, Any]) -> dict[str, Any]:
    """A waiting request's step: nothing to compute."""
    return {}


def wait_plan(waited: int) -> WorkPlan:
    """The idle step of a request waiting for another's prefill (never batched, no stream event)."""
    return WorkPlan(
        kind=WorkUnitKind.CACHE_IO,
        body=idle_body,
        inputs={},
        emits=(),
        label=f"wait for a shared prefix ({waited + 1})",
    )
