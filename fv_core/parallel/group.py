"""A parallel group: rank 0 is the caller's process (it schedules), the other ranks are workers it starts.

Workers hold weights only; every per-request value travels with each step, so a worker keeps no
request state (a cancelled request simply sends no more steps, and a restarted group continues the
requests that were not on the failed step). One step::

    rank 0: broadcast Step(fn, component, inputs, block hook)   -> every rank runs fn (SPMD) under its Rank
    every rank: gather Reply(outputs, rebound hook caches, traffic) -> rank 0 merges the hook caches

``fn`` is a ``"module:attr"`` step function ``fn(component, inputs) -> outputs | None`` that calls
``fv_core.parallel`` collectives. Tensors cross processes on the CPU and land on each rank's device.
A worker whose step raises prints its error and exits, so no rank waits on it in a collective; a
worker that dies (or a collective that times out) fails the step with :class:`WorkerFailed`, and an
error of rank 0's own part is raised as it is. Either way the group restarts on the next step. Gloo on CPU, NCCL on CUDA; ranks beyond 0 use ``cuda:<rank>``.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fv_core.errors import ConfigError, FvError
from fv_core.loop.seam import BLOCKS_INPUT, BlockHook
from fv_core.parallel.comm import TRAFFIC, Rank, running_as
from fv_core.parallel.plan import ParallelPlan, plan_problems
from fv_core.parallel.resident import ResidentSender, Store
from fv_core.registry import resolve_lazy

TIMEOUT_S = float(os.environ.get("FV_PARALLEL_TIMEOUT_S", "120"))  # a collective waits this long for a rank


class WorkerFailed(FvError, RuntimeError):
    """A rank of a parallel group died or stopped answering; the step's requests fail with this."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How a worker loads the same model as rank 0: ``fv_core.load``'s arguments and the plugins to add."""

    model: str | None  # card id or served name
    weights: str | None  # checkpoint folder
    deploy: dict[str, Any] | None  # the DeploymentCard as data, or None
    device: str  # rank 0's device; CUDA ranks use cuda:<rank>
    plugins: tuple[tuple[str, str], ...]  # (plugin name, module) of every plugin rank 0 loaded

    def load(self, rank: int) -> Any:
        from fv_core.deploy.card import parse_deploy
        from fv_core.load import load
        from fv_core.plugins import PluginHost

        host = PluginHost(env={})
        for name, module in self.plugins:
            host.add(importlib.import_module(module), name)
        host.collect()
        deploy = parse_deploy(self.deploy) if self.deploy is not None else None
        device = f"cuda:{rank}" if self.device.startswith("cuda") else self.device
        return load(self.model, self.weights, deploy=deploy, device=device, host=host)


@dataclass(slots=True)
class Step:
    fn: str  # "module:attr" of the step function
    component: str  # the instance component it runs on
    inputs: dict[str, Any]  # without the block hook; resident ones as Store / Resident
    hook: BlockHook | None  # the request's block interceptor and its caches, when one is on
    evict: list[int] = field(default_factory=list)  # resident tensors rank 0 freed


@dataclass(slots=True)
class Reply:
    outputs: dict[str, Any] | None  # what this rank returns (None: it owns no output)
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)  # hook cache entries it rebound
    traffic: int = 0  # bytes this rank sent during the step


def join(rank: int, plan: ParallelPlan, port: int, device: str, store: Any = None) -> Rank:
    """Join the group's torch.distributed world (NCCL for CUDA, gloo otherwise) as ``rank``: through
    rank 0's ``store`` (rank 0), or the store listening on ``port`` (the workers)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # rank 0 through its store, keyed as the workers' tcp:// rendezvous keys theirs
    where = (
        {"store": dist.PrefixStore("default_pg", store)}
        if store is not None
        else {"init_method": f"tcp://127.0.0.1:{port}"}
    )
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group(backend, rank=rank, world_size=plan.world_size, timeout=timeout, **where)
    return make_rank(rank, plan)


def listen(plan: ParallelPlan) -> Any:
    """Rank 0's rendezvous store on a port the OS picks as it binds (no window in which another process
    could take a port chosen first and bound later)."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    return dist.TCPStore(
        "127.0.0.1", 0, plan.world_size, is_master=True, timeout=timeout, wait_for_workers=False
    )


def make_rank(rank: int, plan: ParallelPlan) -> Rank:
    """``rank``'s place; creates the Ulysses and cfg x sp subgroups (every rank must call it, in order)."""
    sp_group = cfg_sp_group = None
    data, cfg, sp = plan.coords(rank)
    for d in range(plan.data):
        members = list(range(d * plan.cfg * plan.sequence, (d + 1) * plan.cfg * plan.sequence))
        group = dist.new_group(members) if len(members) > 1 else None
        if d == data:
            cfg_sp_group = group
        for c in range(plan.cfg):
            span = members[c * plan.sequence : (c + 1) * plan.sequence]
            group = dist.new_group(span) if len(span) > 1 else None
            if (d, c) == (data, cfg):
                sp_group = group
    return Rank(rank, plan, sp, cfg, sp_group, cfg_sp_group)


def execute(instance: Any, rank: Rank, step: Step) -> Reply:
    """Run ``step`` as ``rank``; a hook's caches come back as the entries the step rebound."""
    inputs = dict(step.inputs)
    before = {}
    if step.hook is not None:
        before = {k: dict(v) for k, v in step.hook.caches.items()}
        inputs[BLOCKS_INPUT] = step.hook
    sent = TRAFFIC.total()
    fn = resolve_lazy(step.fn)
    with running_as(rank), torch.no_grad():
        outputs = fn(instance.component(step.component), inputs)
    caches = _rebound(before, step.hook.caches) if step.hook is not None else {}
    return Reply(outputs, caches, TRAFFIC.total() - sent)


def _rebound(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict]:
    """Cache entries (branch -> dict) that are new or had a key rebound."""
    return {
        key: value
        for key, value in after.items()
        if key not in before
        or value.keys() != before[key].keys()
        or any(value[k] is not before[key][k] for k in value)
    }


def payload_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a Step, a Reply, or nested dicts / lists of tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Store):
        return payload_bytes(value.tensor)
    if isinstance(value, Step | Reply):
        fields = (
            (value.inputs, value.hook.caches if value.hook else {})
            if isinstance(value, Step)
            else (
                value.outputs,
                value.caches,
            )
        )
        return sum(payload_bytes(f) for f in fields)
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(payload_bytes(v) for v in value)
    return 0


def moved(value: Any, device: torch.device | str) -> Any:
    """``value`` with every tensor in it (dicts, lists, tuples) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: moved(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(moved(v, device) for v in value)
    return value


def _spawn(rank: int, plan: ParallelPlan, spec: WorkerSpec, port: int, threads: int) -> subprocess.Popen:
    """A fresh interpreter running :func:`worker_main` (never a fork of a threaded server, and never a
    re-import of the caller's ``__main__``); its arguments arrive pickled on stdin."""
    proc = subprocess.Popen([sys.executable, "-m", "fv_core.parallel.worker"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((rank, plan, spec, port, threads)))
    proc.stdin.close()
    return proc


class ParallelGroup:
    """Rank 0's handle on its workers (see the module docstring). One group per process: it owns the
    default torch.distributed process group."""

    def __init__(self, plan: ParallelPlan, spec: WorkerSpec, instance: Any) -> None:
        self.plan, self.spec, self.instance = plan, spec, instance
        self.rank: Rank | None = None
        self.restarts = 0  # how many times the group was started again after a failure
        self.worker_bytes = 0  # bytes the workers sent, summed over steps
        self._procs: list[Any] = []
        self._broken: str | None = None
        self._resident = ResidentSender()
        self._threads = 1  # torch threads of each rank on CPU (set at start)
        self._lock = threading.Lock()

    def start(self) -> None:
        if dist.is_initialized():
            raise FvError(
                "this process already runs a torch.distributed group; fv runs one parallel model per process. "
                "Fix: serve the other parallel model from its own `fv serve`."
            )
        store = listen(self.plan)
        threads = self._threads = max(1, (os.cpu_count() or 1) // self.plan.world_size)
        self._procs = [
            _spawn(r, self.plan, self.spec, store.port, threads) for r in range(1, self.plan.world_size)
        ]
        self.rank = join(0, self.plan, store.port, self.spec.device, store)
        self._resident = ResidentSender()  # fresh workers hold nothing
        self._broken = None

    def run(
        self, fn: str, component: str, inputs: dict[str, Any], label: str = "", resident: tuple[str, ...] = ()
    ) -> list[Reply]:
        """Run one step on every rank; the replies in rank order (rank 0's hook caches already merged).

        :param resident: inputs that stay the same over a request's steps: sent to the workers once."""
        with self._lock:
            if self.rank is None or self._broken is not None:
                if self._broken is not None:
                    self._stop(kill=True)
                    self.restarts += 1
                self.start()
            self._check_alive(label)
            hook = inputs.get(BLOCKS_INPUT)
            common = {k: v for k, v in inputs.items() if k != BLOCKS_INPUT}
            sent = moved(self._resident.encode(common, resident), "cpu")
            step = Step(fn, component, sent, hook if isinstance(hook, BlockHook) else None)
            step.evict = self._resident.evictions()
            try:
                dist.broadcast_object_list([step], src=0)
                TRAFFIC.add("broadcast", payload_bytes(step) * (self.plan.world_size - 1))
                step.inputs = common
                with self._cpu_share():
                    own = execute(self.instance, self._rank(), step)
                replies: list[Any] = [None] * self.plan.world_size
                dist.gather_object(own, replies, dst=0)
            except BaseException as exc:  # the ranks are out of step: the next step restarts the group
                self._broken = f"{type(exc).__name__}: {exc}"
                collective = isinstance(exc, RuntimeError)  # what gloo / NCCL raise when a peer is gone
                if collective and (isinstance(exc, dist.DistError) or self._workers_died()):
                    raise self._failure(label, self._broken) from None
                raise  # rank 0's own error, as it is
        for reply in replies[1:]:
            self.worker_bytes += reply.traffic + payload_bytes(reply)  # its collectives, then its reply
            if step.hook is not None:
                step.hook.caches.update(moved(reply.caches, self.instance.device))
        return [replies[0], *(_reply_on(r, self.instance.device) for r in replies[1:])]

    @contextmanager
    def _cpu_share(self) -> Iterator[None]:
        """On CPU the ranks share the cores: rank 0 takes its share for a step like the workers, and all of
        them again for its own work (text encoding, VAE decode) between steps."""
        if self.instance.device.type != "cpu":
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _rank(self) -> Rank:
        assert self.rank is not None, "started above"
        return self.rank

    def _workers_died(self, grace_s: float = 2.0) -> bool:
        """Whether a worker exited (waiting ``grace_s`` for one that is on its way out)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self._procs):
                return True
            time.sleep(0.05)
        return False

    def _check_alive(self, label: str) -> None:
        dead = [(r, p.poll()) for r, p in enumerate(self._procs, 1) if p.poll() is not None]
        if dead:
            self._broken = ", ".join(f"rank {r} exited with code {code}" for r, code in dead)
            raise self._failure(label, self._broken)

    def _failure(self, label: str, why: str) -> WorkerFailed:
        dead = [
            f"rank {r} (exit code {p.poll()})" for r, p in enumerate(self._procs, 1) if p.poll() is not None
        ]
        who = f"; dead: {', '.join(dead)}" if dead else ""
        return WorkerFailed(
            f"parallel group {self.plan.id} lost a worker during {label or 'a step'} ({why}{who}; a worker's "
            "own error is on this process's stderr). The requests on this step failed; the group restarts "
            "for the next step."
        )

    def close(self) -> None:
        """Stop every worker (they exit at once) and leave the process group."""
        with self._lock:
            self._stop(kill=self._broken is not None)

    def _stop(self, kill: bool) -> None:
        if self.rank is not None and not kill:
            try:
                dist.broadcast_object_list([None], src=0)
            except RuntimeError:
                kill = True
        for proc in self._procs:
            try:
                proc.wait(timeout=0.1 if kill else 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._procs, self.rank = [], None

    def alive_workers(self) -> list[int]:
        """Process ids of the running workers (rank order)."""
        return [p.pid for p in self._procs if p.poll() is None]


def device_count(device: str) -> int:
    """Ranks ``device`` can hold: CUDA devices, or on CPU two processes per core (oversubscribed ranks
    still run, slowly; more would only measure the scheduler of the OS)."""
    if device.startswith("cuda"):
        return torch.cuda.device_count()
    return 2 * (os.cpu_count() or 1)


def start_group(plan: ParallelPlan, card: Any, instance: Any, spec: WorkerSpec, device: str) -> ParallelGroup:
    """Check ``plan`` against the card's contract, the model and the machine (every problem, with its
    numbers), then start the workers and attach the group to ``instance``."""
    shape = getattr(instance, "parallel_shape", None)
    if shape is None:
        raise ConfigError(
            f"card {card.model_id!r} cannot run parallel plan {plan.id!r}: its family runs in one process. "
            "Fix: drop the parallel plan."
        )
    problems = plan_problems(
        plan, card_axes=card.parallelism.axes, devices=device_count(device), device=device, **shape()
    )
    if problems:
        raise ConfigError(
            f"parallel plan {plan.id!r} for {card.model_id!r} is invalid:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    group = ParallelGroup(plan, spec, instance)
    group.start()
    instance.parallel = group
    return group


def _reply_on(reply: Reply, device: torch.device) -> Reply:
    reply.outputs = moved(reply.outputs, device)
    return reply
