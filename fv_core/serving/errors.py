"""HTTP errors, answered as OpenAI's ``{"error": {message, type, param, code}}``.

``ApiError`` is raised anywhere in serving; ``add_error_handlers`` answers it, schema violations (400,
as OpenAI answers them), unknown paths and methods, and unexpected failures (500, without a stack
trace) in that one shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from fv_core.errors import AdmissionInfeasible, ConfigError, error_field, explain
from fv_core.runtime.oom import OutOfMemory
from fv_core.serving.metrics import Metrics
from fv_core.serving.schemas import ErrorBody, ErrorDetail

log = logging.getLogger("fv.serving")


class ApiError(Exception):
    """An HTTP error answered as OpenAI's ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


def failure(exc: Exception, what: str, metrics: Metrics) -> ApiError:
    """The HTTP answer for a request that failed after it was queued: refusals and bad input found
    by the loop are 400, running out of memory alone is 507 (Insufficient Storage: the device cannot
    hold it; the message has the numbers), the rest 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AdmissionInfeasible):  # the engine can never fit it: the request is too big
        metrics.refusals.labels("infeasible").inc()
        return ApiError(400, str(exc), "admission_infeasible")
    if isinstance(exc, ConfigError):  # e.g. a prompt longer than the model's context
        return ApiError(400, str(exc), "invalid_request", exc.param)
    if isinstance(exc, OutOfMemory):  # it ran out of memory alone: the device cannot hold this request
        return ApiError(507, str(exc), OutOfMemory.code)
    return ApiError(500, f"{what} failed: {type(exc).__name__}: {exc}", "generation_failed")


def describe(
    exc: ValidationError | RequestValidationError, model: type[BaseModel] | None = None
) -> tuple[str, str, str | None]:
    """(message, code, the first bad field) of a validation error."""
    allowed = model.model_fields if model is not None else None
    return explain(exc, "invalid request", allowed), "invalid_request", error_field(exc.errors()[0]) or None


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, *describe(exc))

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


def _error(
    status: int,
    message: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
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
