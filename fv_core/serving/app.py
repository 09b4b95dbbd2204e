"""The FastAPI app: OpenAI-shaped video and image endpoints, models, health and metrics.

Every error is answered as ``{"error": {message, type, param, code}}``:
400 bad or over-limit input and schema violations (as OpenAI answers them), 401 bad API key,
404 unknown model or video, 409 content not ready or a weights version clash, 413 body too large,
429 full queue (Retry-After). ``POST /v1/weights`` (fv's own) takes a trainer's weights: a
``WeightSyncPlan`` as JSON and a safetensors file (see ``fv_core.training.sync``).
OpenAI fields fv does not use (``user``, ``quality``, ...) are accepted and ignored, and named in
the ``x-fv-ignored-fields`` response header.
Unexpected failures answer 500 without a stack trace.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, File, Form, Query, Request
from fastapi import UploadFile as UploadedFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from fv_core.deploy.card import DeploymentCard
from fv_core.errors import error_field, explain
from fv_core.plugins import PluginHost, load_plugins
from fv_core.registry import resolve_lazy
from fv_core.serving.chat import completion, sse
from fv_core.serving.jobs import JobStore, default_data_dir
from fv_core.serving.metrics import CONTENT_TYPE, Metrics
from fv_core.serving.schemas import (
    IGNORED_FIELDS,
    ChatCompletion,
    ChatCompletionCreate,
    ErrorBody,
    ErrorDetail,
    ImageBase,
    ImageData,
    ImageEditBase,
    ImagesResponse,
    Model,
    ModelList,
    SessionCreate,
    SessionDeleted,
    SessionObject,
    Strict,
    Video,
    VideoBase,
    VideoDeleted,
    VideoList,
    WeightsSynced,
    with_params,
)
from fv_core.serving.service import ApiError, Image, Service
from fv_core.serving.stream import events as stream_events

log = logging.getLogger("fv.serving")
POLL_AFTER_MS = "200"  # hint for the openai client's create_and_poll
MAX_BODY_BYTES = 25 * 2**20  # a request body (with an uploaded image) is read up to this size
MAX_DEPTH = 8  # JSON nesting a body may have (plugin_options is 2 deep)
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 429)
}
_FORM_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")


def create_app(
    deploy: DeploymentCard,
    host: PluginHost | None = None,
    data_dir: str | Path | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    replica: str | None = None,
) -> FastAPI:
    """An app serving ``deploy``; models load and the engine starts in its lifespan.

    ``replica`` (a fleet replica's unique id) opens the data dir's job store in shared mode, so
    several replicas serve one job table (see ``JobStore``); answers then carry ``x-fv-replica``.

    The request bodies (and so the OpenAPI schema) are OpenAI's fields plus the request params
    of the deployed cards' tasks, from their loops' Params."""
    metrics = Metrics()
    plugins = host if host is not None else load_plugins()
    params = _served_params(deploy, plugins)
    video_body = with_params(VideoBase, params, "VideoCreate")
    image_body = with_params(ImageBase, params, "ImageCreate")
    edit_body = with_params(ImageEditBase, params, "ImageEdit")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = JobStore(
            data_dir or deploy.data_dir or default_data_dir(), deploy.retention.max_age_s, owner=replica
        )
        service = Service(deploy, plugins, store, metrics, device)
        try:
            await service.start()
            app.state.service = service
            yield
        finally:
            await service.stop()
            store.close()

    app = FastAPI(title="fv", summary="OpenAI-compatible video and image generation", lifespan=lifespan)
    _add_error_handlers(app)

    @app.middleware("http")
    async def request_id(request: Request, call_next: Any) -> Response:
        """Every answer carries ``x-request-id``: the client's own, else a new one; logs name it."""
        rid = request.headers.get("x-request-id", "")[:128] or uuid.uuid4().hex
        request.state.request_id = rid
        response = await call_next(request)
        response.headers["x-request-id"] = rid
        if replica is not None:
            response.headers["x-fv-replica"] = replica
        log.info("%s %s -> %s [request %s]", request.method, request.url.path, response.status_code, rid)
        return response

    app.include_router(_v1_router(api_key, video_body, image_body, edit_body), prefix="/v1")

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        service: Service = request.app.state.service
        health = {"status": "ok", "models": sorted(service.models), "running": len(service.live)}
        return health if replica is None else {**health, "replica": replica}

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _service(request: Request) -> Service:
    return request.app.state.service


def _served_params(deploy: DeploymentCard, host: PluginHost) -> list[type[Any]]:
    """The Params classes of every task of every deployed card (cards that fail to assemble add none:
    loading reports them)."""
    classes: list[type[Any]] = []
    for m in deploy.models:
        try:
            card = host.card(m.card)
        except Exception:
            continue
        for task in card.programs:
            cls = resolve_lazy(card.params_of(task))
            if cls not in classes:
                classes.append(cls)
    return classes


def _v1_router(
    api_key: str | None, video_body: type[Strict], image_body: type[Strict], edit_body: type[Strict]
) -> APIRouter:
    bearer = HTTPBearer(auto_error=False)

    def authorize(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key is None:
            return
        if creds is None or not secrets.compare_digest(creds.credentials.encode(), api_key.encode()):
            raise ApiError(
                401,
                "missing or incorrect API key. Fix: send 'Authorization: Bearer <key>' with the server's key.",
                "invalid_api_key",
            )

    router = APIRouter(dependencies=[Depends(authorize)], responses=ERRORS)

    @router.post("/videos", response_model=Video, openapi_extra=_body_doc(video_body))
    async def create_video(
        request: Request, response: Response, service: Service = Depends(_service)
    ) -> Video:
        body = _validate(video_body, _drop_ignored(await _read_body(request), response))
        return await service.create_video(body, request.state.request_id)  # type: ignore[arg-type]

    @router.get("/videos", response_model=VideoList)
    async def list_videos(
        after: str | None = Query(None, max_length=64),
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        service: Service = Depends(_service),
    ) -> VideoList:
        data, has_more = service.store.list(after, limit, order)
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return VideoList(data=data, first_id=first, last_id=last, has_more=has_more)

    @router.get("/videos/{video_id}", response_model=Video)
    async def retrieve_video(
        video_id: str, response: Response, service: Service = Depends(_service)
    ) -> Video:
        response.headers["openai-poll-after-ms"] = POLL_AFTER_MS
        return _video(service, video_id)

    @router.get(
        "/videos/{video_id}/content",
        response_class=FileResponse,
        responses={200: {"content": {"video/mp4": {}}}},
    )
    async def video_content(
        video_id: str, variant: Literal["video"] = "video", service: Service = Depends(_service)
    ) -> FileResponse:
        video = _video(service, video_id)
        path = service.store.artifact(video_id)
        if path is None:
            raise ApiError(
                409,
                f"video {video_id!r} is {video.status}; content exists only for completed videos. "
                "Fix: poll GET /v1/videos/{id} until status is 'completed'.",
                "video_not_ready",
                "video_id",
            )
        return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")

    @router.get(
        "/videos/{video_id}/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def stream_video(video_id: str, service: Service = Depends(_service)) -> StreamingResponse:
        """The job's chunks as server-sent events while it runs (see ``fv_core.serving.stream``), then
        the job; a job not running here sends the job alone."""
        _video(service, video_id)
        body = stream_events(video_id, service.streams.get(video_id), lambda: _video(service, video_id))
        return StreamingResponse(body, media_type="text/event-stream", headers={"cache-control": "no-cache"})

    @router.delete("/videos/{video_id}", response_model=VideoDeleted)
    async def delete_video(video_id: str, service: Service = Depends(_service)) -> VideoDeleted:
        if not service.delete(video_id):
            raise _no_video(video_id)
        return VideoDeleted(id=video_id)

    @router.post("/images/generations", response_model=ImagesResponse, openapi_extra=_body_doc(image_body))
    async def generate_images(
        request: Request, response: Response, service: Service = Depends(_service)
    ) -> ImagesResponse:
        body: Any = _validate(image_body, _drop_ignored(await _read_body(request), response))
        return _images(body, await service.generate_images(body))

    @router.post("/images/edits", response_model=ImagesResponse, openapi_extra=_body_doc(edit_body))
    async def edit_images(
        request: Request, response: Response, service: Service = Depends(_service)
    ) -> ImagesResponse:
        """OpenAI's image edit (multipart: ``image`` or one ``image[]`` file, the instruction as ``prompt``)."""
        data = _drop_ignored(await _read_body(request), response)
        files = await _uploads(request, "image")
        data["image"] = files[0] if len(files) == 1 else data.get("image")
        body: Any = _validate(edit_body, data)
        if body.mask is not None:
            raise ApiError(
                400, "mask is not supported: fv edits the whole image. Fix: drop mask.", "unsupported_parameter", "mask"
            )  # fmt: skip
        if len(files) != 1:
            raise ApiError(
                400,
                f"got {len(files)} image files; an edit takes exactly one. Fix: send one 'image' file field.",
                "invalid_image",
                "image",
            )
        parts = await Service.image_parts(files[0], "image")
        return _images(body, await service.generate_images(body, parts))

    @router.post(
        "/chat/completions",
        response_model=ChatCompletion,
        responses={200: {"content": {"text/event-stream": {}}}},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": ChatCompletionCreate.model_json_schema()}}}},
    )  # fmt: skip
    async def chat_completions(
        request: Request, response: Response, service: Service = Depends(_service)
    ) -> Any:
        """OpenAI's chat completion; ``stream: true`` answers server-sent chunks ending with ``[DONE]``."""
        body: Any = _validate(ChatCompletionCreate, _drop_ignored(await _read_body(request), response))
        model, rid = await service.chat(body)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        text = service.chat_text(rid, model)
        first = await anext(
            text
        )  # bad input the loop finds (a prompt over the context) is a 4xx, not a stream
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                sse(cid, created, model, _prepend(first, text), include),
                media_type="text/event-stream",
                headers={**response.headers, "cache-control": "no-cache"},  # the ignored-fields header
            )
        pieces = [first] + [item async for item in text]
        metrics = pieces.pop()
        assert isinstance(metrics, dict), "chat_text ends with the result's metrics"
        return completion(cid, created, model, "".join(map(str, pieces)), metrics)

    @router.post("/sessions", response_model=SessionObject)
    async def open_session(request: Request, service: Service = Depends(_service)) -> SessionObject:
        """fv: open a session; videos created with its ``session_id`` continue one video, each with its
        own prompt, from where the last one stopped (causal cards)."""
        body: Any = _validate(SessionCreate, await _read_body(request))
        model, sid = service.open_session(body.model, body.ttl_s)
        return SessionObject(id=sid, model=model)

    @router.delete("/sessions/{session_id}", response_model=SessionDeleted)
    async def close_session(session_id: str, service: Service = Depends(_service)) -> SessionDeleted:
        """fv: close a session and free its cache (a video continuing it fails at its next step)."""
        service.close_session(session_id)
        return SessionDeleted(id=session_id)

    @router.post("/weights", response_model=WeightsSynced)
    async def sync_weights(
        plan: str = Form(description='the WeightSyncPlan as JSON: {"role", "components", "version"}'),
        weights: UploadedFile = File(description="safetensors of the tensors, keyed '<component>.<name>'"),
        model: str | None = Form(None, description="served model name; default: the first deployed"),
        service: Service = Depends(_service),
    ) -> WeightsSynced:
        """Hot weight sync from a trainer (``fv_core.training.push_weights``): requests accepted before
        it finish on the weights they started with, those after run on the new ones."""
        return await service.sync_weights(model, plan, await weights.read())

    @router.get("/models", response_model=ModelList)
    async def list_models(service: Service = Depends(_service)) -> ModelList:
        mode = service.deploy.determinism
        return ModelList(
            data=[Model(id=m.name, created=m.created, determinism=mode) for m in service.models.values()]
        )

    return router


def _images(body: Any, images: list[Image]) -> ImagesResponse:
    data = [ImageData(b64_json=i.b64_png, revised_prompt=i.text) for i in images]
    return ImagesResponse(created=int(time.time()), data=data, size=body.size)


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


async def _uploads(request: Request, name: str) -> list[UploadFile]:
    """The files of a multipart field sent as ``name`` or ``name[]`` (the openai client's list form)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return []
    form = await request.form()
    return [v for k, v in form.multi_items() if k in (name, f"{name}[]") and isinstance(v, UploadFile)]


def _video(service: Service, video_id: str) -> Video:
    video = service.store.get(video_id)
    if video is None:
        raise _no_video(video_id)
    return video


def _no_video(video_id: str) -> ApiError:
    return ApiError(
        404,
        f"no video {video_id[:80]!r}. Fix: use an id from POST /v1/videos or GET /v1/videos.",
        "video_not_found",
        "video_id",
    )


# -- request bodies ---------------------------------------------------------------------------------


def _body_doc(model: type[Strict]) -> dict[str, Any]:
    """OpenAPI for a body read by hand: the same schema as JSON and as a multipart form."""
    schema = model.model_json_schema()
    content = {"application/json": {"schema": schema}, "multipart/form-data": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}


def _drop_ignored(data: dict[str, Any], response: Response) -> dict[str, Any]:
    """The body without the OpenAI fields fv ignores; the response names them (``x-fv-ignored-fields``)."""
    ignored = sorted(IGNORED_FIELDS & set(data))
    if ignored:
        response.headers["x-fv-ignored-fields"] = ", ".join(ignored)
        log.warning("ignored OpenAI fields %s", ignored)
    return {k: v for k, v in data.items() if k not in IGNORED_FIELDS}


def _depth(value: Any) -> int:
    """How deeply dicts and lists nest in ``value``."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


async def _read_body(request: Request) -> dict[str, Any]:
    """A JSON object or a (multipart / urlencoded) form, with ``a[b][c]`` form keys nested; at most
    ``MAX_BODY_BYTES`` and ``MAX_DEPTH`` levels of nesting."""
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY_BYTES:
        raise ApiError(
            413, f"body is {size} bytes; at most {MAX_BODY_BYTES} are read. Fix: send a smaller body (or image).",
            "body_too_large",
        )  # fmt: skip
    kind = request.headers.get("content-type", "")
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        try:
            form = await request.form()
        except Exception as exc:  # malformed multipart: the client's fault
            raise ApiError(
                400,
                f"unreadable form body: {exc}. Fix: send multipart/form-data with its boundary, or a JSON object.",
                "invalid_body",
            ) from None
        return _nest([(k, v) for k, v in form.multi_items()])
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(
            413, f"body is over {MAX_BODY_BYTES} bytes. Fix: send a smaller body.", "body_too_large"
        )
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(
            400, f"body is not valid JSON ({exc}). Fix: send a JSON object.", "invalid_json"
        ) from None
    except RecursionError:
        data = None
    if data is None or _depth(data) > MAX_DEPTH:
        raise ApiError(
            400, f"body nests deeper than {MAX_DEPTH} levels. Fix: send a flat JSON object.", "invalid_json"
        )
    if not isinstance(data, dict):
        raise ApiError(400, f"body must be a JSON object; got {type(data).__name__}.", "invalid_json")
    return data


def _nest(items: list[tuple[str, str | UploadFile]]) -> dict[str, Any]:
    """``plugin_options[p][k]=v`` form fields -> ``{"plugin_options": {"p": {"k": "v"}}}``."""
    out: dict[str, Any] = {}
    for key, value in items:
        match = _FORM_KEY.match(key)
        path = [match[1], *re.findall(r"\[([^\[\]]*)\]", match[2])] if match else [key]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ApiError(400, f"form field {key!r} nests under a plain value.", "invalid_body", key)
        if isinstance(node.get(path[-1]), dict):
            raise ApiError(
                400, f"form field {key!r} is given both as a value and as an object.", "invalid_body", key
            )
        node[path[-1]] = value
    return out


def _validate(model: type[Strict], data: dict[str, Any]) -> Strict:
    try:
        return model.model_validate(data)
    except ValidationError as exc:  # 400, as OpenAI answers schema violations
        raise ApiError(400, *_describe(exc, model)) from None


def _describe(exc: Any, model: type[Strict] | None = None) -> tuple[str, str, str | None]:
    """(message, code, the first bad field) of a validation error."""
    allowed = model.model_fields if model is not None else None
    return explain(exc, "invalid request", allowed), "invalid_request", error_field(exc.errors()[0]) or None


# -- error answers ----------------------------------------------------------------------------------


def _error(
    status: int, message: str, code: str | None, param: str | None = None, headers=None
) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    detail = ErrorDetail(message=message, type=kind, param=param, code=code)
    return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status, headers=headers)


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route answers on this path (Starlette's 405 names only the first route's)."""
    allowed = {"OPTIONS"}
    for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"):
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in app.router.routes):
            allowed.add(method)
    return sorted(allowed)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, *_describe(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            allowed = _allowed_methods(app, request)
            headers = {"Allow": ", ".join(allowed)}
            if request.method == "OPTIONS":
                return Response(status_code=204, headers=headers)
            message = f"{request.method} is not allowed on {request.url.path}. Fix: use one of {allowed}."
            return _error(405, message, "method_not_allowed", headers=headers)
        code = "not_found" if exc.status_code == 404 else None
        return _error(exc.status_code, str(exc.detail), code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = getattr(request.state, "request_id", "-")
        log.exception("unexpected error on %s %s [request %s]", request.method, request.url.path, rid)
        return _error(500, f"internal error ({type(exc).__name__}); the server logged it.", "internal_error")
