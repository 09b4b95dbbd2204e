"""HTTP request and response bodies, shaped like OpenAI's video, image and chat completion APIs.

Requests forbid unknown fields: the request params of the served cards
(``num_frames``, ``seed``, ... from each loop's Params) arrive as top-level
fields, which is where the ``openai`` client merges ``extra_body``. Multipart forms send every value as a string; pydantic's lax
mode turns ``"5"`` into 5.
"""

from __future__ import annotations

from copy import copy
from typing import Annotated, Any, Literal, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from fv_core.request.params import refuse_booleans


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, data: Any) -> Any:
        return refuse_booleans(cls, data)


class AdapterChoice(Strict):
    """One served LoRA adapter a request runs (fv)."""

    name: str = Field(min_length=1, max_length=200)
    scale: float | None = Field(None, description="default: the adapter's deployed scale")


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
    adapters: list[AdapterChoice] = Field(
        default_factory=list, description="fv: LoRA adapters this model serves (GET /v1/models), with scales"
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
    adapters: list[AdapterChoice] = Field(
        default_factory=list, description="fv: LoRA adapters this model serves (GET /v1/models), with scales"
    )


class ImageEditBase(ImageBase):
    """``POST /v1/images/edits`` (multipart) fields of OpenAI's API: the image to edit and the instruction;
    the served cards' request params join them."""

    image: Any = Field(description="the image to edit (an uploaded file)")
    mask: Any = Field(None, description="not supported: fv edits the whole image")


# Body fields that are OpenAI's, not a card's request params.
API_FIELDS = frozenset(VideoBase.model_fields) | frozenset(ImageEditBase.model_fields)
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
        "metadata",
        "store",
        "service_tier",
    }
)


Base = TypeVar("Base", bound=Strict)


def with_params(base: type[Base], params: list[type[BaseModel]], name: str) -> type[Base]:
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
    download_url: str | None = None  # a completed job's presigned mp4 link, where the storage gives one (S3)


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
    revised_prompt: str | None = None  # the thinking the image was made from (``think``), else null


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
    adapters: list[dict[str, Any]] = Field(
        default_factory=list, description="fv: the LoRA adapters requests may name (name, scale, rank, ...)"
    )
    workflow: bool = Field(False, description="fv: a workflow of the deploy file (stages over served models)")


class AdapterAdd(Strict):
    """``POST /v1/adapters`` (fv, operators): serve one more LoRA adapter, or a new version of one."""

    model: str | None = Field(None, description="served model name; default: the first deployed model")
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    path: str = Field(min_length=1, description="a LoRA .safetensors file or folder on the server")
    scale: float = 1.0
    into: dict[str, list[str]] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class SessionCreate(Strict):
    """``POST /v1/sessions`` (fv): a video continued across requests (``session_id`` on ``/v1/videos``)."""

    model: str | None = Field(None, description="served model name; default: the first deployed model")
    ttl_s: float | None = Field(None, gt=0, description="closed after this many idle seconds (default 600)")
    # a real-time session (fv_core.serving.realtime): made chunk by chunk at fps while a client listens
    # on /v1/sessions/{id}/ws, steered there
    fps: float | None = Field(
        None, gt=0, le=240, description="real-time: the frame rate each chunk is due at"
    )
    prompt: str | None = Field(None, max_length=4096, description="real-time: the first prompt")
    seed: int | None = Field(None, ge=0, description="real-time: chunk i runs with seed + i (default 0)")
    params: dict[str, Any] | None = Field(None, description="real-time: other request params of every chunk")
    linger_s: float | None = Field(
        None, gt=0, le=3600, description="real-time: closed after this long without a client (default 30)"
    )


class SessionObject(BaseModel):
    id: str
    object: Literal["session"] = "session"
    model: str
    fps: float | None = None  # real-time sessions: the target frame rate
    predicted: dict[str, float] | None = None  # real-time: the load admission predicted (None: unmeasured)
    replica: str | None = None  # where it lives (a fleet's replica; its requests carry x-session-id: <id>)


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True


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
    # a fleet (replicas on one shared data dir) only: every replica applies the sync, in the log's order
    fleet_seq: int | None = None  # the sync's place in the fleet's weight log
    replicas_behind: list[str] = Field(default_factory=list)  # live replicas not caught up when it answered
    replica_errors: dict[str, str] = Field(default_factory=dict)  # replica -> why the sync failed there


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error response: OpenAI's ``{"error": {...}}``."""

    error: ErrorDetail


# -- chat completions ---------------------------------------------------------------------------------


class ImageUrl(Strict):
    url: str = Field(description="a data URL: data:image/png;base64,...")
    detail: Literal["auto", "low", "high"] | None = None


class TextContent(Strict):
    type: Literal["text"]
    text: str


class ImageContent(Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[TextContent | ImageContent, Field(discriminator="type")]]
    name: str | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class ChatCompletionCreate(Strict):
    """``POST /v1/chat/completions``: OpenAI's fields fv serves, plus ``top_k`` and ``think`` (fv)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    model: str | None = Field(None, description="served model name; default: the first deployed model")
    max_tokens: int | None = Field(
        None, ge=1, description="most new tokens (the card's default when omitted)"
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="as max_tokens (it wins when both are set)"
    )
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0: greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="fv: keep the k most likely tokens; 0: all")
    stop: str | list[str] | None = Field(None, description="a stop string or up to 16 of them")
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=1, description="choices per request: fv answers one")
    stream: bool = False
    stream_options: StreamOptions | None = None
    think: bool | None = Field(None, description="fv: reason inside <think> ... </think> first")
    plugin_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="plugin -> options, for plugins the deployment enables"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
