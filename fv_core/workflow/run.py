"""A loaded workflow: its stages run in order, each a full request on its own resident model.

``generate(**params)`` validates the workflow's params once (a pydantic model built from its declared
params, typed as the stages that take them type them), then runs each stage with its bindings: a
request param, or an earlier stage's artifact (an image becomes the next stage's image part). A
fan-out stage's candidates run as one batch on the engine; its ``select`` scorer scores them in one
batch and keeps the best. The result is the last stage's artifact whose provenance nests every stage's
(and the candidates' scores). The stages are a generator (``plan``) that yields each stage's work
(``StageRun``: requests for a model; ``Score``: candidates for a scorer): ``generate`` runs it here, a
server (``arun``) on its engine, where the requests batch with its other requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from fv_core.errors import Cancelled, ConfigError, StageFailed, explain
from fv_core.registry import resolve_lazy
from fv_core.request.parts import image_part
from fv_core.workflow.spec import REQUEST, StageSpec, WorkflowSpec


@dataclass(frozen=True)
class StageRun:
    """A stage's requests for the served model ``model`` (``where``: ``2/3 motion``, nested ``2/2 a > 1/2 b``)."""

    where: str
    model: str
    requests: list[Any]


@dataclass(frozen=True)
class Score:
    """Candidates ``frames [B, F, H, W, 3]`` (0..1) of the prompts that asked for them, for ``scorer``."""

    scorer: Any
    frames: torch.Tensor
    prompts: list[str]

    def run(self) -> list[float]:
        with torch.inference_mode():
            return [float(s) for s in self.scorer(self.frames, self.prompts)]


# yields each stage's work, is sent its results (None to start; scores for a Score), returns the artifact
Plan = Generator[StageRun | Score, Any, Any]


@dataclass
class LoadedWorkflow:
    """A workflow bound to its loaded models (``fv_core.load(workflow_id, deploy=...)``)."""

    workflow_id: str
    spec: WorkflowSpec
    models: dict[str, Any]  # served name (or nested workflow id) -> LoadedModel / LoadedWorkflow
    scorers: dict[str, Any] = field(default_factory=dict)  # stage name -> scorer (frames, prompts) -> [B]
    deploy: dict[str, Any] = field(default_factory=dict)  # the deploy file it came from (for a replay)

    def close(self) -> None:
        for model in self.models.values():
            model.close()

    def params_model(self) -> type[BaseModel]:
        """The workflow's request params: each typed as the first stage binding it types it."""
        fields: dict[str, Any] = {}
        for name, default in self.spec.params.items():
            annotation = self._param_type(name)
            fields[name] = (annotation, ... if default is None else default)
        config = ConfigDict(extra="forbid")
        return create_model(f"{self.workflow_id}-params", __config__=config, **fields)  # type: ignore[call-overload]

    def prepare(self, raw: Mapping[str, Any]) -> BaseModel:
        cls = self.params_model()
        try:
            return cls.model_validate({k: v for k, v in raw.items() if v is not None})
        except ValidationError as exc:
            raise ConfigError(
                explain(exc, f"request to workflow {self.workflow_id!r}", cls.model_fields)
            ) from None

    def generate(self, on_event: Callable[[StageRun, Any], None] | None = None, **params: Any) -> Any:
        """Run the workflow here, each stage's requests as one batch on an engine (under the deploy's
        ``determinism: bitwise``, sharing calls only through batch-invariant bodies); returns its last stage's
        artifact (with ``keep: all``, ``.stages`` holds each stage's by name), its provenance nesting
        every stage's. ``on_event(stage, event)`` receives each stage's first request's stream events."""
        from fv_core.runtime import Engine

        def run(work: StageRun | Score) -> Any:
            if isinstance(work, Score):
                return work.run()
            first = work.requests[0].request_id
            engine = Engine(on_event=None if on_event is None else _first_request(work, first, on_event))
            jobs = [self.models[work.model].job(r) for r in work.requests]
            bitwise = self.deploy.get("determinism") == "bitwise"
            return engine.run_batched(jobs, batching="invariant" if bitwise else True)

        plan = self.plan(self.prepare(params).model_dump())
        results: Any = None
        error: Exception | None = None
        with torch.inference_mode():
            while True:
                try:
                    work = plan.send(results) if error is None else plan.throw(error)
                except StopIteration as done:
                    return done.value
                try:
                    results, error = run(work), None
                except Exception as exc:  # thrown into the plan, which names the stage
                    results, error = None, exc

    async def arun(self, params: BaseModel, execute: Callable[[StageRun], Awaitable[list]]) -> Any:
        """:meth:`generate` on someone else's engine: ``await execute(stage)`` runs each stage's requests (a
        server submits them to its engine, where they batch with everything else); scoring runs in a
        thread, off the caller's event loop."""
        plan, results, error = self.plan(params.model_dump()), None, None
        while True:  # (the first send is None: it starts the generator)
            try:
                work = plan.send(results) if error is None else plan.throw(error)
            except StopIteration as done:
                return done.value
            try:
                results, error = (
                    await (asyncio.to_thread(work.run) if isinstance(work, Score) else execute(work)),
                    None,
                )
            except Exception as exc:  # thrown into the plan, which names the stage
                results, error = None, exc

    def plan(self, request: dict[str, Any], where: str = "") -> Plan:
        """The workflow as a generator: it yields each stage's work and is sent its results; it returns
        the final artifact."""
        start = time.perf_counter()
        done: dict[str, Any] = {}
        stages: dict[str, Any] = {}
        count = len(self.spec.stages)
        for i, stage in enumerate(self.spec.stages):
            at = f"{where}{i + 1}/{count} {stage.name}"
            try:
                done[stage.name] = yield from self._stage(stage, request, done, at)
            except (Cancelled, StageFailed):
                raise
            except Exception as exc:
                raise _stage_error(at, stage, exc) from exc
            stages[stage.name] = done[stage.name].provenance
        provenance = {
            "workflow": self.workflow_id,
            "params": request,
            "stages": stages,
            "seconds": time.perf_counter() - start,
            "deploy": self.deploy,
        }
        kept = {"stages": done} if self.spec.keep == "all" else {}
        return dataclasses.replace(done[self.spec.stages[-1].name], provenance=provenance, **kept)

    # -- stages ------------------------------------------------------------------------------

    def _stage(self, stage: StageSpec, request: dict[str, Any], done: dict[str, Any], where: str) -> Plan:
        """One stage: its bound params and parts, its request (or ``fan_out`` candidates, seeds ``seed`` ..
        ``seed + N - 1``, the ``select`` scorer keeping the best); returns its artifact."""
        model = self.models[stage.model]
        raw, parts = dict(stage.params), []
        for target, origin, name in stage.sources():
            value = request[name] if origin == REQUEST else _output(done[origin], name)
            if target == "image":
                parts.append(image_part(value))
            else:
                raw[target] = value
        if isinstance(model, LoadedWorkflow):
            return (yield from model.plan(model.prepare(raw).model_dump(), f"{where} > "))
        seed = int(raw.get("seed", 0))
        requests = [
            model.prepare(
                {**raw, "seed": seed + i} if stage.fan_out > 1 else raw,
                task=stage.task,
                parts=parts,
                request_id=f"{stage.name}-{uuid.uuid4().hex[:8]}-{i}",
            )
            for i in range(stage.fan_out)
        ]
        start = time.perf_counter()
        results = yield StageRun(where, stage.model, requests)
        seconds = (time.perf_counter() - start) / len(requests)
        candidates = [model.artifact(r, res, seconds) for r, res in zip(requests, results, strict=True)]
        if stage.fan_out == 1:
            return candidates[0]
        frames = torch.stack([torch.from_numpy(_frames(a)) for a in candidates])
        prompts = [str(getattr(r.params, "prompt", "")) for r in requests]
        scores = yield Score(self.scorers[stage.name], frames, prompts)
        best = int(np.argmax(scores))
        provenance = {
            **candidates[best].provenance,
            "candidates": [{"seed": seed + i, "score": s} for i, s in enumerate(scores)],
            "selected": best,
            "scorer": stage.scorer.model_dump() if stage.scorer else None,
        }
        return dataclasses.replace(candidates[best], provenance=provenance)

    def _param_type(self, name: str) -> Any:
        for stage in self.spec.stages:
            for target, origin, source in stage.sources():
                model = self.models[stage.model]
                if origin == REQUEST and source == name and not isinstance(model, LoadedWorkflow):
                    params = resolve_lazy(model.card.params_of(stage.task or model.card.tasks[0]))
                    if target in params.model_fields:
                        return params.model_fields[target].annotation
        return Any


def _output(artifact: Any, name: str) -> Any:
    """An earlier stage's ``image`` (a video's last frame), ``video`` frames or ``text``."""
    if name == "text":
        return artifact.text if isinstance(artifact.text, str) else artifact.text.text
    if name == "video":
        return artifact.frames
    return artifact.image if hasattr(artifact, "image") else artifact.frames[-1]


def _frames(artifact: Any) -> np.ndarray:
    """``[F, H, W, 3]`` of a video, ``[1, H, W, 3]`` of an image: what a reward scores."""
    return artifact.frames if hasattr(artifact, "frames") else artifact.image[None]


def _stage_error(where: str, stage: StageSpec, exc: Exception) -> Exception:
    """``exc`` naming the stage it failed in (a ConfigError stays one: a caller's 400)."""
    message = f"stage {where} ({stage.model} {stage.task or 'default task'}): {type(exc).__name__}: {exc}"
    if isinstance(exc, ConfigError):
        return ConfigError(message, exc.param)
    return StageFailed(message)


def _first_request(stage: StageRun, request_id: str, on_event: Callable[[StageRun, Any], None]) -> Callable:
    """An engine's ``on_event`` passing on the events of the stage's request ``request_id`` only."""

    def events(event: Any) -> None:
        if event.request_id == request_id:
            on_event(stage, event)

    return events


def bind_workflows(
    workflows: Mapping[str, WorkflowSpec],
    model_of: Callable[[str], Any],
    host: Any,
    deploy: dict[str, Any],
) -> dict[str, LoadedWorkflow]:
    """Every workflow bound to the models its stages run (``model_of(served name)``, nested workflows to
    each other) and the scorers they select with (``host``'s, built with each stage's options)."""
    out: dict[str, LoadedWorkflow] = {}

    def bind(workflow_id: str) -> LoadedWorkflow:
        if workflow_id not in out:
            spec = workflows[workflow_id]
            models = {
                s.model: bind(s.model) if s.model in workflows else model_of(s.model) for s in spec.stages
            }
            scorers = {
                s.name: host.registries.scorers.get(s.scorer.scorer)(**s.scorer.options)
                for s in spec.stages
                if s.scorer is not None
            }
            out[workflow_id] = LoadedWorkflow(workflow_id, spec, models, scorers, deploy)
        return out[workflow_id]

    for workflow_id in workflows:
        bind(workflow_id)
    return out
