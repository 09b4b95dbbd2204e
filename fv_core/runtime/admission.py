"""Admission: reserve compute seconds and memory before a request's work runs.

Compute is predicted seconds of admitted, unfinished work; memory is each
bound instance's resident bytes (counted once per instance: weights, and
caches allocated whole such as a paged KV pool) plus every admitted request's
worst-case peak; KV pages are, per paged KV pool, the most pages each admitted
request can hold at once (``Estimate.kv_pages``, reserved on the pool itself,
so engines sharing an instance share the count). A request that could never
fit, even on an idle engine, fails fast with AdmissionInfeasible; one that
fits later waits; a full queue answers QueueFull with a retry hint.
Reservations are consumed step by step and the rest refunded on completion,
early stop, cancel or failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from fv_core.errors import AdmissionInfeasible
from fv_core.kv import PagedKVPool


@dataclass(slots=True)
class Budget:
    """The engine's named budgets."""

    compute_s: float = math.inf  # predicted seconds of admitted, unfinished work at once
    memory_bytes: float = math.inf  # resident weights + worst-case step peaks
    max_running: int = 256  # requests admitted at once
    max_waiting: int = 1024  # queue limit; beyond it submit raises QueueFull


@dataclass(slots=True)
class Estimate:
    """Worst-case needs of a request's remaining work."""

    compute_s: float  # predicted seconds of all remaining steps (at the cap for open-ended loops)
    peak_bytes: int  # largest transient memory of any step
    kv_pool: PagedKVPool | None = None  # the KV pool the request writes (None: it holds no KV pages)
    kv_pages: int = 0  # most pages of kv_pool it holds at once (pages shared by its contexts once)


@dataclass(slots=True)
class Reservation:
    """What one admitted request holds."""

    request_id: str  # owner
    instance_key: int  # id() of the bound instance
    compute_s: float  # reserved predicted seconds not yet consumed
    peak_bytes: int  # reserved worst-case peak
    kv_pool: PagedKVPool | None = None  # the pool its KV pages are reserved on
    kv_pages: int = 0  # reserved KV pages


def resident_bytes(instance: Any) -> int:
    """An instance's resident bytes: its ``resident_bytes`` attribute, else its nn.Module tensors."""
    declared = getattr(instance, "resident_bytes", None)
    if declared is not None:
        return int(declared() if callable(declared) else declared)
    if isinstance(instance, nn.Module):
        tensors = [*instance.parameters(), *instance.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
    return 0


class AdmissionController:
    """Tracks free budget; every change goes through reserve / consume / release."""

    def __init__(self, budget: Budget | None = None) -> None:
        self.budget = budget or Budget()
        self.compute_s = 0.0  # reserved compute seconds
        self.peak_bytes = 0  # reserved peaks
        self.resident: dict[int, tuple[int, int]] = {}  # instance key -> (bytes, requests bound)
        self.running: dict[str, Reservation] = {}  # request id -> reservation

    @property
    def memory_bytes(self) -> int:
        return self.peak_bytes + sum(b for b, _ in self.resident.values())

    @property
    def headroom_bytes(self) -> float:
        """The memory budget less the bound instances' resident bytes: what step peaks may use at once."""
        return self.budget.memory_bytes - sum(b for b, _ in self.resident.values())

    def usage(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "memory_bytes": self.memory_bytes, "running": len(self.running)}

    def check_feasible(self, request_id: str, need: Estimate, instance: Any) -> None:
        """Raise AdmissionInfeasible if ``need`` exceeds the budget even on an idle engine."""
        b, res = self.budget, resident_bytes(instance)
        if need.compute_s > b.compute_s:
            raise AdmissionInfeasible(
                f"request {request_id!r}: compute needs {need.compute_s:.3f} s predicted but the budget is "
                f"{b.compute_s:.3f} s; raise Budget.compute_s or ask for fewer steps / a smaller shape"
            )
        if res + need.peak_bytes > b.memory_bytes:
            raise AdmissionInfeasible(
                f"request {request_id!r}: predicted memory needs {res} resident + {need.peak_bytes} peak = "
                f"{res + need.peak_bytes} bytes but the memory budget is {b.memory_bytes:.0f} bytes, so it "
                "can never run. Fix: use a smaller shape (fewer frames, lower resolution), or raise the "
                "budget (a deploy file's scheduling.memory_budget_bytes; Budget.memory_bytes)"
            )
        pool = need.kv_pool
        if pool is not None and need.kv_pages > pool.num_pages:
            raise AdmissionInfeasible(
                f"request {request_id!r}: KV needs {need.kv_pages} pages of {pool.page_size} tokens "
                f"({need.kv_pages * pool.page_bytes} bytes) but the KV pool holds {pool.num_pages} "
                f"({pool.nbytes} bytes). Fix: lower max_tokens, shorten the prompt, or raise the card's "
                "kv cache budget (caches['kv'].max_bytes)"
            )

    def try_reserve(self, request_id: str, need: Estimate, instance: Any) -> Reservation | None:
        """Reserve ``need`` if it fits now, else None (the request keeps waiting)."""
        key = id(instance)
        new_resident = 0 if key in self.resident else resident_bytes(instance)
        fits = (
            len(self.running) < self.budget.max_running
            and self.compute_s + need.compute_s <= self.budget.compute_s
            and self.memory_bytes + new_resident + need.peak_bytes <= self.budget.memory_bytes
        )
        if not fits:
            return None
        if need.kv_pool is not None and not need.kv_pool.reserve(need.kv_pages):
            return None  # the pool's pages are promised to running requests
        size, bound = self.resident.get(key, (new_resident, 0))
        self.resident[key] = (size, bound + 1)
        self.compute_s += need.compute_s
        self.peak_bytes += need.peak_bytes
        res = Reservation(request_id, key, need.compute_s, need.peak_bytes, need.kv_pool, need.kv_pages)
        self.running[request_id] = res
        return res

    def consume(self, res: Reservation, seconds: float) -> None:
        """A step of predicted ``seconds`` ran: its share of the reservation is spent."""
        spent = min(seconds, res.compute_s)
        res.compute_s -= spent
        self.compute_s = max(0.0, self.compute_s - spent)

    def release(self, res: Reservation) -> None:
        """Refund what is left (completion, early stop, cancel, error)."""
        if self.running.pop(res.request_id, None) is None:
            return
        self.compute_s = max(0.0, self.compute_s - res.compute_s) if self.running else 0.0  # no float drift
        self.peak_bytes -= res.peak_bytes
        if res.kv_pool is not None:
            res.kv_pool.unreserve(res.kv_pages)
        size, bound = self.resident[res.instance_key]
        if bound == 1:
            del self.resident[res.instance_key]
        else:
            self.resident[res.instance_key] = (size, bound - 1)
        res.compute_s = 0.0

    def retry_after_s(self) -> float:
        """Predicted seconds until the soonest running request frees its reservation."""
        return min((r.compute_s for r in self.running.values()), default=0.0)
