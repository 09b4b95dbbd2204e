"""HTTP request and response bodies, shaped like OpenAI's video and image APIs.

Requests forbid unknown fields: the request params of the served cards
(``num_frames``, ``seed``, ... from each loop's Params) arrive as top-level
fields, which is where the ``openai`` client merges ``extra_body``. Multipart forms send every value as a string; pydantic's lax
mode turns ``"5"`` into 5.
"""

from __future__ import annotations

from copy import copy
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from fv_core.request.params import refuse_booleans


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, data: Any) -> Any:
        return refuse_booleans(cls, data)


class VideoBase(Strict):
    """``POST /v1/videos`` fields of OpenAI's API; the served cards' request params join them."""

    prompt: str = Field(min_length=1, max_length=10_000)
    model: str | None = Field(None, description="served model name; default: the first deployed model")
    task: str | None = Field(None, description="the model's task (fv); default: its first that outputs video")
    seconds: float | None = Field(
        None, gt=0, le=3600, description="clip length; sets num_frames = seconds*fps+1"
    )
    size: str | None = Field(None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$", description="WIDTHxHEIGHT")
    input_reference: Any = Field(None, description="reference image (upload), for tasks that take an image")
    plugin_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="plugin -> options, for plugins the deployment enables"
    )


class ImageBase(Strict):
    """``POST /v1/images/generations`` fields of OpenAI's API; the served cards' request params join them."""

    prompt: str = Field(min_length=1, max_length=10_000)
    model: str | None = None
    task: str | None = Field(
        None, description="the model's task (fv); default: its first that outputs images"
    )
    n: int = Field(1, ge=1, le=10)
    size: str | None = Field(
        None, pattern=r"^([0-9]{1,5}x[0-9]{1,5}|auto)$", description="WIDTHxHEIGHT or auto"
    )
    response_format: Literal["b64_json"] = "b64_json"
    plugin_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="plugin -> options, for plugins the deployment enables"
    )


# Body fields that are OpenAI's, not a card's request params.
API_FIELDS = frozenset(VideoBase.model_fields) | frozenset(ImageBase.model_fields)
# OpenAI fields other clients send that fv accepts and ignores (named in the x-fv-ignored-fields header).
IGNORED_FIELDS = frozenset(
    {
        "user",
        "quality",
        "style",
        "background",
        "moderation",
        "output_compression",
        "output_format",
        "partial_images",
    }
)


def with_params(base: type[Strict], params: list[type[BaseModel]], name: str) -> type[Strict]:
    """``base`` plus every field of ``params`` (the served cards' Params), optional: an omitted field
    takes the card's default. Its OpenAPI schema is the derived request contract."""
    fields: dict[str, Any] = {}
    for cls in params:
        for field, info in cls.model_fields.items():
            if field in base.model_fields or field in fields:
                continue
            optional = copy(info)
            optional.default = None
            fields[field] = (Optional[info.annotation], optional)  # noqa: UP045 - a runtime annotation
    return create_model(name, __base__=base, **fields)


class JobError(BaseModel):
    code: str
    message: str


class Video(BaseModel):
    """A video job."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int = Field(ge=0, le=100)
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None  # when a finished job and its files are deleted (the deploy's retention)
    size: str  # "WxH" of the resolved request
    seconds: str
    prompt: str | None = None
    error: JobError | None = None


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    size: str | None = None
    output_format: Literal["png"] = "png"


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fv"
    determinism: Literal["bitwise", "batched"] = Field(
        "batched",
        description="bitwise: a seeded request's output does not depend on load; batched: within tolerance",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class WeightsSynced(BaseModel):
    """``POST /v1/weights``: the new weights are live (requests accepted from now on run on them)."""

    object: Literal["weights.sync"] = "weights.sync"
    model: str  # served model name
    role: str  # the plan's training role
    versions: dict[str, str]  # component -> its new weights_version
    previous: dict[str, str]  # component -> the version it replaced
    tensors: dict[str, int]  # component -> tensors replaced
    cache_entries_dropped: int  # cached features of the replaced versions that went
    requests_on_previous: int  # requests accepted before, finishing on the replaced weights


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error response: OpenAI's ``{"error": {...}}``."""

    error: ErrorDetail
