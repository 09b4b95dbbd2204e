"""Request bodies, read by hand: a JSON object or a (multipart / urlencoded) form, size- and
depth-limited, OpenAI fields fv ignores dropped (and named in ``x-fv-ignored-fields``), validated into
a body model (a violation is a 400 naming the field).

The routes read bodies themselves (rather than through FastAPI's parameters) so one endpoint takes JSON
and multipart alike, as OpenAI's do; ``body_doc`` gives the OpenAPI schema for both.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, TypeVar

from fastapi import Request, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from fv_core.serving.errors import ApiError, describe
from fv_core.serving.schemas import IGNORED_FIELDS

log = logging.getLogger("fv.serving")
MAX_BODY_BYTES = 25 * 2**20  # a request body (with an uploaded image) is read up to this size
MAX_DEPTH = 8  # JSON nesting a body may have (plugin_options is 2 deep)
_FORM_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")
Body = TypeVar("Body", bound=BaseModel)


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a body read by hand: the same schema as JSON and as a multipart form."""
    schema = model.model_json_schema()
    content = {"application/json": {"schema": schema}, "multipart/form-data": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}


async def read_body(request: Request) -> dict[str, Any]:
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


def drop_ignored(data: dict[str, Any], response: Response) -> dict[str, Any]:
    """The body without the OpenAI fields fv ignores; the response names them (``x-fv-ignored-fields``)."""
    ignored = sorted(IGNORED_FIELDS & set(data))
    if ignored:
        response.headers["x-fv-ignored-fields"] = ", ".join(ignored)
        log.warning("ignored OpenAI fields %s", ignored)
    return {k: v for k, v in data.items() if k not in IGNORED_FIELDS}


def validate(model: type[Body], data: dict[str, Any]) -> Body:
    """``data`` as ``model``; a violation answers 400, as OpenAI answers schema violations."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, *describe(exc, model)) from None


async def uploads(request: Request, name: str) -> list[UploadFile]:
    """The files of a multipart field sent as ``name`` or ``name[]`` (the openai client's list form)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return []
    form = await request.form()
    return [v for k, v in form.multi_items() if k in (name, f"{name}[]") and isinstance(v, UploadFile)]


def _depth(value: object) -> int:
    """How deeply dicts and lists nest in ``value``."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _nest(items: list[tuple[str, str | UploadFile]]) -> dict[str, Any]:
    """``plugin_options[p][k]=v`` form fields -> ``{"plugin_options": {"p": {"k": "v"}}}``; a list of
    objects as the openai client sends it, ``adapters[][name]=a`` ``adapters[][scale]=1`` -> ``{"adapters":
    [{"name": "a", "scale": "1"}]}`` (a field the last object has already starts the next)."""
    out: dict[str, Any] = {}
    for key, value in items:
        match = _FORM_KEY.match(key)
        path = [match[1], *re.findall(r"\[([^\[\]]*)\]", match[2])] if match else [key]
        if len(path) == 3 and path[1] == "":
            rows = out.setdefault(path[0], [])
            if not isinstance(rows, list):
                raise ApiError(400, f"form field {key!r} mixes a list with a value.", "invalid_body", key)
            if not rows or path[2] in rows[-1]:
                rows.append({})
            rows[-1][path[2]] = value
            continue
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
