"""A loaded workflow: its stages run in order, each a full request on its own resident model.

``generate(**params)`` validates the workflow's params once (a pydantic model built from its declared
params, typed as the stages that take them type them), then runs each stage with its bindings: a
request param, or an earlier stage's artifact (an image becomes the next stage's image part). A
fan-out stage's candidates run as one batch on the engine; its ``select`` reward keeps the best. The
result is the last stage's artifact whose provenance nests every stage's (and the candidates' scores).
The stages are a generator (``plan``) that yields each stage's requests: ``generate`` runs them on an
engine of its own, a server (``arun``) on its engine, where they batch with its other requests.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from fv_core.errors import ConfigError, explain
from fv_core.registry import resolve_lazy
from fv_core.request.parts import image_part
from fv_core.workflow.spec import REQUEST, StageSpec, WorkflowSpec

# yields (served model, requests) per stage, is sent their results (None to start), returns the artifact
Plan = Generator[tuple[str, list[Any]], Any, Any]


@dataclass
class LoadedWorkflow:
    """A workflow bound to its loaded models (``fv_core.load(workflow_id, deploy=...)``)."""

    workflow_id: str
    spec: WorkflowSpec
    models: dict[str, Any]  # served name (or nested workflow id) -> LoadedModel / LoadedWorkflow
    rewards: dict[str, Any] = field(default_factory=dict)  # reward name -> scorer (frames, prompts) -> [B]
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

    def generate(self, **params: Any) -> Any:
        """Run the workflow here, each stage's requests as one batch on an engine; returns its last stage's
        artifact (with ``keep: all``, ``.stages`` holds each stage's by name), its provenance nesting
        every stage's."""
        from fv_core.runtime import Engine

        plan = self.plan(self.prepare(params).model_dump())
        results: list[Any] | None = None
        with torch.inference_mode():
            while True:
                try:
                    model, requests = plan.send(results)
                except StopIteration as done:
                    return done.value
                results = Engine().run_batched([self.models[model].job(r) for r in requests])

    async def arun(self, params: BaseModel, execute: Callable[[str, list], Awaitable[list]]) -> Any:
        """:meth:`generate` on someone else's engine: ``await execute(model, requests)`` runs each stage's
        requests (a server submits them to its engine, where they batch with everything else)."""
        plan, results = self.plan(params.model_dump()), None
        while True:  # (the first send is None: it starts the generator)
            try:
                model, requests = plan.send(results)
            except StopIteration as done:
                return done.value
            results = await execute(model, requests)

    def plan(self, request: dict[str, Any]) -> Plan:
        """The workflow as a generator: it yields ``(served model, requests)`` for each stage and is sent
        their results; it returns the final artifact."""
        start = time.perf_counter()
        done: dict[str, Any] = {}
        stages: dict[str, Any] = {}
        for stage in self.spec.stages:
            done[stage.name] = yield from self._stage(stage, request, done)
            stages[stage.name] = done[stage.name].provenance
        provenance = {
            "workflow": self.workflow_id,
            "params": request,
            "stages": stages,
            "seconds": time.perf_counter() - start,
            "deploy": self.deploy,
        }
        artifact = dataclasses.replace(done[self.spec.stages[-1].name], provenance=provenance)
        if self.spec.keep == "all":
            artifact.stages = done  # type: ignore[attr-defined]
        return artifact

    # -- stages ------------------------------------------------------------------------------

    def _stage(self, stage: StageSpec, request: dict[str, Any], done: dict[str, Any]) -> Plan:
        """One stage: its bound params and parts, its request (or ``fan_out`` candidates, seeds ``seed`` ..
        ``seed + N - 1``, the ``select`` reward keeping the best); returns its artifact."""
        model = self.models[stage.model]
        raw, parts = dict(stage.params), []
        for target, origin, name in stage.sources():
            value = request[name] if origin == REQUEST else _output(done[origin], name)
            if target == "image":
                parts.append(image_part(value))
            else:
                raw[target] = value
        if isinstance(model, LoadedWorkflow):
            return (yield from model.plan(model.prepare(raw).model_dump()))
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
        results = yield stage.model, requests
        seconds = (time.perf_counter() - start) / len(requests)
        candidates = [model.artifact(r, res, seconds) for r, res in zip(requests, results, strict=True)]
        if stage.fan_out == 1:
            return candidates[0]
        frames = torch.stack([torch.from_numpy(_frames(a)) for a in candidates])
        prompts = [str(getattr(r.params, "prompt", "")) for r in requests]
        scores = [float(s) for s in self.rewards[str(stage.select)](frames, prompts)]
        best = int(np.argmax(scores))
        provenance = {
            **candidates[best].provenance,
            "candidates": [{"seed": seed + i, "score": s} for i, s in enumerate(scores)],
            "selected": best,
            "reward": stage.select,
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
