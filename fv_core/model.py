"""A loaded model: a card bound to live weights, and the front door of every request to it.

``prepare`` turns a raw request (CLI flags, HTTP JSON, Python kwargs) into the typed
:class:`Request` once: the task's program, the card's defaults, the deploy limits, the loop's
Params (with the card's rules), the parts the loop accepts and the plugin options merged once.
``generate`` runs one request and returns the task's artifacts with a provenance that
replays it. :func:`fv_core.load` builds LoadedModels; nothing else should.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ValidationError

from fv_core.artifacts import AudioArtifact, ImageArtifact, TextArtifact, VideoArtifact
from fv_core.card.spec import LoopSpec, ModelCard, ProgramSpec
from fv_core.card.validate import check_loop_request
from fv_core.deploy.card import Limits
from fv_core.errors import ConfigError, LimitExceeded, UnknownKeyError, error_field, explain
from fv_core.loop.contracts import Loop, LoopResult, StreamEvent
from fv_core.program import Program, Stage
from fv_core.registry import resolve_lazy
from fv_core.request.params import Params, field_extra
from fv_core.request.parts import Part, image_part
from fv_core.request.request import Request

Progress = Callable[[int, int], None]
Artifact = VideoArtifact | ImageArtifact | AudioArtifact | TextArtifact


@dataclass(frozen=True, slots=True)
class OptionsPolicy:
    """Which plugins' options a request may set, their schemas, and the deployment's own values."""

    schemas: Mapping[str, type[BaseModel]] = field(default_factory=dict)  # plugin -> options schema
    enabled: frozenset[str] | None = None  # plugins a deployment enables; None: any with a schema
    base: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # deployment's options per plugin
    per_request: frozenset[str] = frozenset()  # plugins with interceptors (they read options per request)

    def merge(self, asked: Mapping[str, Mapping[str, Any]] | None) -> dict[str, BaseModel]:
        """The deployment's options overridden by the request's, validated once per plugin."""
        asked = asked or {}
        merged: dict[str, BaseModel] = {}
        for plugin in [*self.base, *(p for p in asked if p not in self.base)]:
            if plugin in asked and self.enabled is not None and plugin not in self.enabled:
                raise ConfigError(
                    f"plugin options name {plugin!r}, which this deployment does not enable (enabled: "
                    f"{sorted(self.enabled)}). Fix: drop the options or ask the operator to enable {plugin!r}.",
                    param="plugin_options",
                )
            if plugin in asked and plugin not in self.per_request:
                raise ConfigError(
                    f"plugin {plugin!r} has no interceptor, so a request cannot set its options (its kernels "
                    "take them once, at load). Fix: drop them, or set them in the deploy file.",
                    param="plugin_options",
                )
            schema = self.schemas.get(plugin)
            if schema is None:
                raise ConfigError(
                    f"plugin {plugin!r} takes no options; got {sorted(asked.get(plugin, {}))}. Fix: drop them.",
                    param="plugin_options",
                )
            try:
                merged[plugin] = schema.model_validate({**self.base.get(plugin, {}), **asked.get(plugin, {})})
            except ValidationError as exc:
                where = f"options for plugin {plugin!r}"
                raise ConfigError(explain(exc, where, schema.model_fields), param="plugin_options") from None
        return merged


@dataclass
class LoadedModel:
    """A card bound to a live instance: the unit the CLI, the server, eval and training run requests on."""

    card: ModelCard  # the assembled card, bound to its weights
    instance: Any  # live components, shared by every request
    weights: str  # checkpoint folder (a Hugging Face repo's: its local snapshot)
    weights_repo: dict[str, str] | None = None  # the Hugging Face repo, revision and commit it came from
    source: str = ""  # what was loaded: the card id, or the folder a card was built from
    plugin: str | None = None  # plugin that registered the card
    kernels: dict[str, dict[str, Any]] = field(default_factory=dict)  # op -> selection record
    interceptors: tuple[Any, ...] = ()  # enabled interceptors, attached to every request
    interceptor_names: tuple[str, ...] = ()  # their registered names (a deploy file's, a replay's)
    limits: Limits | None = None  # the deployment's limits (None: the card's own rules only)
    options: OptionsPolicy = field(default_factory=OptionsPolicy)  # request plugin-option policy
    versions: dict[str, str | None] = field(default_factory=dict)  # distribution -> version (provenance)
    deploy_plugins: list[str] = field(default_factory=list)  # plugins a replay must enable
    parallel: Any = None  # the ParallelGroup its steps run on (None: this process alone)

    def close(self) -> None:
        """Stop the parallel group's workers, if any (a model without one has nothing to stop)."""
        if self.parallel is not None:
            self.parallel.close()

    # -- programs -------------------------------------------------------------------------------

    def program(self, task: str | None = None) -> tuple[str, ProgramSpec]:
        """``(task, program)``; the card's first task when ``task`` is None."""
        task = task or self.card.tasks[0]
        if task not in self.card.programs:
            raise ConfigError(
                f"model {self.card.model_id!r} has no task {task!r}; its tasks are {self.card.tasks}. "
                "Fix: ask for one of those.",
                param="task",
            )
        return task, self.card.programs[task]

    def params_model(self, task: str | None = None) -> type[Params]:
        """The typed Params class of ``task`` (the program's, else its first stage's loop's)."""
        return resolve_lazy(self.card.params_of(self.program(task)[0]))

    def loop(self, loop_id: str) -> Loop:
        """The loop ``loop_id`` bound to this instance (loops hold no per-request state)."""
        return resolve_lazy(self.card.loops[loop_id].loop_factory)(self.instance)

    def runnable(self, task: str) -> Loop | Program:
        """What the scheduler runs for ``task``: its loop, or a Program of its loops."""
        program = self.card.programs[task]
        if len(program.stages) == 1:
            return self.loop(program.stages[0])
        return Program(
            task,
            [
                Stage(f"{i}:{loop_id}", self.loop(loop_id), resolve_lazy(program.binds.get(i)))
                for i, loop_id in enumerate(program.stages)
            ],
        )

    # -- the front door -------------------------------------------------------------------------

    def prepare(
        self,
        raw: Mapping[str, Any] | None = None,
        *,
        task: str | None = None,
        parts: Iterable[Part] = (),
        plugin_options: Mapping[str, Mapping[str, Any]] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        adapters: Iterable[Any] = (),
    ) -> Request:
        """The typed request for ``raw`` params (``None`` values take the card's defaults); ``adapters``:
        the served LoRA adapters it runs, each a name, ``(name, scale)`` or ``{"name", "scale"}``."""
        task, program = self.program(task)
        loop_id = program.stages[0]
        cls = self.params_model(task)
        given = {k: v for k, v in (raw or {}).items() if v is not None}
        try:
            params = cls.model_validate({**program.defaults, **given})
        except ValidationError as exc:
            param = error_field(exc.errors()[0]) or None
            where = f"request to {self.card.model_id!r} (task {task!r})"
            raise ConfigError(explain(exc, where, cls.model_fields), param=param) from None
        self._check_limits(params)
        params.check(self.card, loop_id)
        self._check_card_caps(params)
        if "num_inference_steps" in cls.model_fields:
            recipe_loop = self.card.loops[loop_id].variant_of or loop_id
            check_loop_request(self.card, recipe_loop, params.num_inference_steps)  # type: ignore[attr-defined]
        parts = tuple(parts)
        self._check_parts(task, self.card.loops[loop_id], parts)
        request = Request(
            request_id=request_id or uuid.uuid4().hex[:16],
            task=task,
            params=params,
            parts=parts,
            options=self.options.merge(plugin_options),
            seed=params.seed,
            priority=priority,
            interceptors=self.interceptors,
            adapters=self.adapter_uses(adapters),
        )
        for interceptor in self.interceptors:  # options valid by schema but impossible for this model
            check = getattr(interceptor, "check_request", None)
            if check is not None:
                check(request, self.instance)
        return request

    def adapter_uses(self, asked: Iterable[Any]) -> tuple[Any, ...]:
        """The adapters a request names, checked against those this model serves (ConfigError)."""
        asked = list(asked or ())
        if not asked:
            return ()
        plane = getattr(self.instance, "adapters", None)
        if plane is None:
            raise ConfigError(
                f"{self.card.model_id!r} takes no LoRA adapters (its card declares none). "
                "Fix: drop adapters, or use a model that takes them (Wan, LTX-2).",
                param="adapters",
            )
        if self.parallel is not None:
            raise ConfigError(
                f"{self.card.model_id!r} runs on a parallel group ({self.parallel.plan.id}); adapters are "
                "applied in this process only. Fix: serve the model without a parallel plan to use adapters.",
                param="adapters",
            )
        return plane.uses(asked)

    def _adapter_record(self, use: Any) -> dict[str, Any]:
        """An adapter a request ran, for its provenance (the file, so a replay can load it again)."""
        entry = self.instance.adapters.known(use.key)
        return {
            "name": use.name,
            "version": use.version,
            "scale": use.scale,
            "path": entry.path,
            "into": dict(entry.into),
        }

    def _check_parts(self, task: str, loop: LoopSpec, parts: tuple[Part, ...]) -> None:
        """The loop takes only the kinds it ``accepts``, and each kind it ``requires`` exactly once."""
        refused = [p.kind for p in parts if p.kind not in loop.accepts]
        if refused:
            raise ConfigError(
                f"task {task!r} of {self.card.model_id!r} takes input parts {loop.accepts or 'none'} besides "
                f"its params; got {refused}. Fix: drop them, or use a task that takes them.",
                param="parts",
            )
        for kind in loop.requires:
            count = sum(p.kind == kind for p in parts)
            if count != 1:
                flags = (
                    " (Python image=..., CLI --image PATH, HTTP input_reference)" if kind == "image" else ""
                )
                raise ConfigError(
                    f"task {task!r} of {self.card.model_id!r} needs exactly one {kind}; the request has {count}. "
                    f"Fix: send one {kind}{flags}.",
                    param=kind,
                )

    def _check_card_caps(self, params: Params) -> None:
        """The card's own caps (``capabilities.max_frames`` / ``max_resolution``), for any family whose
        params have ``num_frames`` / ``height`` and ``width``."""
        caps = self.card.capabilities
        frames = getattr(params, "num_frames", None)
        if caps.max_frames is not None and frames is not None and frames > caps.max_frames:
            raise ConfigError(
                f"num_frames={frames} exceeds this card's max_frames={caps.max_frames}. "
                f"Fix: use at most {caps.max_frames}",
                param="num_frames",
            )
        height, width = getattr(params, "height", None), getattr(params, "width", None)
        if caps.max_resolution and height is not None and width is not None:
            max_h, max_w = caps.max_resolution
            if height * width > max_h * max_w:
                raise ConfigError(
                    f"size {width}x{height} exceeds this card's max resolution {max_w}x{max_h}. "
                    "Fix: ask for a smaller size",
                    param="height",
                )

    def _check_limits(self, params: Params) -> None:
        if self.limits is None:
            return
        for name in type(params).model_fields:
            limit = field_extra(type(params), name, "limit")
            value = getattr(params, name)
            if limit is not None and limit not in Limits.model_fields:
                raise ConfigError(
                    f"{type(params).__name__}.{name} names the limit {limit!r}, which deploy files do not have "
                    f"(they have {sorted(Limits.model_fields)}). Fix: the model plugin must name one of those."
                )
            if limit is not None and value is not None and value > getattr(self.limits, limit):
                cap = getattr(self.limits, limit)
                raise LimitExceeded(
                    f"{name}={value} exceeds this deployment's limit {limit}={cap}. "
                    f"Fix: ask for at most {cap}.",
                    param=name,
                )

    def job(self, request: Request) -> tuple[Loop | Program, Request, Any]:
        """``(runnable, request, instance)`` for an engine."""
        return self.runnable(request.task), request, self.instance

    def generate(
        self,
        *,
        task: str | None = None,
        parts: Iterable[Part] = (),
        plugin_options: Mapping[str, Mapping[str, Any]] | None = None,
        progress: Progress | None = None,
        image: Any = None,
        on_partial: Callable[[Any], None] | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
        adapters: Iterable[Any] = (),
        **params: Any,
    ) -> Artifact:
        """Run one request: ``model.generate(prompt="a red circle moving left", seed=1)``.

        Omitted params take the card's defaults (``fv cards --json`` lists them); returns the
        task's artifact (a VideoArtifact for ``t2v``), with a provenance that replays it.
        ``image`` (a PIL image, path, bytes or array) is one more image part; without a ``task``
        it picks the card's first task that takes an image. ``on_partial`` receives each partial output as
        the loop makes it (a chat's ``{"token", "delta"}``: stream ``delta`` to show the text as it comes).
        ``on_event`` receives every event of the run (a progress event's ``data`` is its step's label).
        ``adapters``: served LoRA adapters to run, e.g. ``["style"]`` or ``[("style", 0.7)]``."""
        from fv_core.runtime.engine import Engine

        parts = tuple(parts)
        if image is not None:
            parts += (image_part(image),)
            task = task or self.image_task()
        request = self.prepare(
            params, task=task, parts=parts, plugin_options=plugin_options, adapters=adapters
        )

        def events(event: StreamEvent) -> None:
            if on_event is not None:
                on_event(event)
            if progress is not None and event.kind == "progress" and event.total:
                progress(event.step, event.total)
            elif on_partial is not None and event.kind == "partial":
                on_partial(event.data)

        start = time.perf_counter()
        with torch.inference_mode():
            engine = Engine(device=getattr(self.instance, "device", "cpu"), on_event=events)
            result = engine.run_one(*self.job(request))
        return self.artifact(request, result, time.perf_counter() - start)

    def open_session(self, ttl_s: float | None = None) -> str:
        """Open a session: requests with ``session_id=`` then continue one output across requests (a
        causal card's video, chunk after chunk, each request with its own prompt); closed by
        ``close_session`` or after ``ttl_s`` idle seconds."""
        opener = getattr(self.instance, "open_session", None)
        if opener is None:
            raise ConfigError(
                f"{self.card.model_id!r} keeps no sessions: its loops make each output in one request. "
                "Fix: use a card with a causal loop (e.g. wan2.1-t2v-tiny-causal)."
            )
        return str(opener() if ttl_s is None else opener(ttl_s))

    def close_session(self, session_id: str) -> bool:
        """Close a session and free what it holds (False: it was not open)."""
        closer = getattr(self.instance, "close_session", None)
        return bool(closer(session_id)) if closer is not None else False

    def image_task(self) -> str | None:
        """The card's first task whose loop takes an image part (None when none does)."""
        card = self.card
        return next(
            (t for t in card.tasks if "image" in card.loops[card.programs[t].stages[0]].accepts), None
        )

    # -- results --------------------------------------------------------------------------------

    def artifact(self, request: Request, result: LoopResult, seconds: float) -> Artifact:
        """The task's artifact from a finished result (video and audio make one video with sound; image
        and text one image carrying the text)."""
        outputs = self.card.programs[request.task].outputs
        prov = self.provenance(request, result, seconds)
        out = result.outputs
        audio = None
        if "audio" in outputs:
            audio = AudioArtifact(_numpy(out["audio"]), int(out["sample_rate"]), prov)
        if "video" in outputs:
            fps = int(getattr(request.params, "fps", 16))
            return VideoArtifact(_numpy(out["frames"]), fps, prov, audio=audio)
        if "image" in outputs:
            text = TextArtifact(str(out["text"]), prov) if "text" in outputs else None
            return ImageArtifact(_numpy(out["frames"])[0], prov, text=text)
        if audio is not None:
            return audio
        return TextArtifact(str(out["text"]), prov)

    def provenance(self, request: Request, result: LoopResult, seconds: float) -> dict[str, Any]:
        """Everything needed to replay ``request`` on this model and to tell what ran."""
        return {
            "model": self.source,
            "card": self.card.model_id,
            "parent": self.card.parent,
            "recipe": self.card.recipe.model_dump(),
            "task": request.task,
            "params": request.params.model_dump(mode="json"),
            "parts": [p.kind for p in request.parts],  # kinds only: a replay cannot re-send them
            "weights": self.weights,
            "weights_repo": self.weights_repo,
            # the versions the request ran on (pinned at init: a weight sync may have landed since)
            "weights_hash": dict(
                result.metrics.get("weights_versions") or getattr(self.instance, "weights_versions", {})
            ),
            "adapters": [self._adapter_record(u) for u in request.adapters],
            "kernels": result.metrics.get("kernels", self.kernels),
            "interceptors": list(self.interceptor_names),
            # the options the deployment and the request set (the rest are each plugin's own defaults)
            "plugin_options": {
                p: o.model_dump(mode="json", exclude_unset=True) for p, o in request.options.items()
            },
            "deploy": {
                "plugins": self.deploy_plugins,
                "kernels": {op: r["variant"] for op, r in self.kernels.items()},
                "limits": self.limits.model_dump() if self.limits is not None else None,
                "parallel": self.parallel.plan.id if self.parallel is not None else "single",
                "precision": self.card.precision.default,
            },
            "metrics": result.metrics,
            "seconds": round(seconds, 4),
            "versions": self.versions,
        }


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu().numpy()
    return np.asarray(value)


def unknown_model(model: str, available: Iterable[str]) -> UnknownKeyError:
    return UnknownKeyError(
        f"unknown model {model!r}: neither a registered card nor a diffusers-format folder "
        f"(no {model}/model_index.json) nor a Hugging Face repo id (owner/name). Cards: {sorted(available)}. "
        "Fix: pick a card (see `fv cards`), or pass the path of a checkpoint folder or a repo id."
    )
