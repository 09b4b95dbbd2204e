"""Cross-model workflows as a deploy file declares them: stages on served models, each bound to the
workflow's request and to earlier stages' artifacts.

```yaml
workflows:
  t2i-to-i2v:
    params: {prompt: null, seed: 0}          # the workflow's request params (null: required)
    stages:
      - {name: still, model: wan-t2i, task: t2i, bind: {prompt: request.prompt, seed: request.seed}}
      - {name: motion, model: wan-i2v, task: i2v, bind: {image: still.image, prompt: request.prompt}}
```

A binding ``target: source`` sets a stage's param (or, for ``image``, its image part) from
``request.<param>`` or ``<stage>.<output>``: ``image`` (an image stage's picture, a video stage's last
frame), ``video`` (its frames) or ``text``. ``fan_out: N`` runs N candidates (seeds ``seed``, ``seed+1``,
...) and ``select: SCORER`` (or ``select: {scorer: SCORER, options: {...}}``) keeps the one a registered
scorer (``fv_register_scorers``) scores best. A stage's ``model`` may name another workflow (workflows nest).
A plugin's workflow (``fv_register_workflows``) names card ids as models; a deploy file serves it with
``workflows: {ID: registered-id}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

REQUEST = "request"  # a binding source naming the workflow's own request
OUTPUTS = ("image", "video", "text")  # what a binding may take from an earlier stage
PARTS = ("image",)  # binding targets that become input parts, not params


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SelectSpec(Strict):
    """The scorer that keeps the best of a fan-out's candidates, and the options it is built with."""

    scorer: str
    options: dict[str, Any] = Field(default_factory=dict)  # e.g. clip-score's {model: FOLDER_OR_REPO}


class StageSpec(Strict):
    """One stage: a task of a served model (or a nested workflow)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    model: str  # a served model's name in the deploy file, or another workflow's id
    task: str | None = None  # the model's task (default: its first)
    params: dict[str, Any] = Field(default_factory=dict)  # fixed params of this stage
    bind: dict[str, str] = Field(default_factory=dict)  # param or part <- "request.X" / "<stage>.<output>"
    fan_out: int = Field(1, ge=1, le=64)  # candidates, seeds seed .. seed+N-1
    select: str | SelectSpec | None = None  # a registered scorer that keeps the best candidate

    @property
    def scorer(self) -> SelectSpec | None:
        return SelectSpec(scorer=self.select) if isinstance(self.select, str) else self.select

    def sources(self) -> list[tuple[str, str, str]]:
        """``(target, origin, field)`` per binding: origin ``request`` or an earlier stage's name."""
        out = []
        for target, source in self.bind.items():
            origin, _, name = source.partition(".")
            out.append((target, origin, name))
        return out


class WorkflowSpec(Strict):
    """A workflow: its request params with their defaults, its stages in order, what it keeps."""

    description: str = ""
    params: dict[str, Any] = Field(default_factory=dict)  # request param -> default (None: required)
    stages: list[StageSpec] = Field(min_length=1)
    keep: Literal["last", "all"] = "last"  # "all": every stage's artifact is returned, not only the last
