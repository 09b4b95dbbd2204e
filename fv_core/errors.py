"""fv's few exception types. Each subclasses a builtin, and each message
quotes the bad value, the rule it broke and the fix."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class FvError(Exception):
    """Base of fv's errors."""


class ConfigError(FvError, ValueError):
    """Bad user input or configuration (deploy file, request, options).

    ``param`` names the request field at fault, when there is one (HTTP answers carry it)."""

    def __init__(self, message: str, param: str | None = None):
        self.param = param
        super().__init__(message)


class LimitExceeded(ConfigError):
    """A request asks for more than the deployment allows."""


class CardValidationError(ConfigError):
    """A model card is inconsistent; raised before any weight loads."""

    def __init__(self, card: str, field: str, problem: str, fix: str):
        self.card, self.field = card, field
        super().__init__(f"card {card!r}: {field}: {problem}. Fix: {fix}")


class RecipeLoopMismatch(ConfigError):
    """A request asks a card for a loop its weights were not made for."""


class UnknownKeyError(FvError, KeyError):
    """A registry key that nobody registered; the message lists what is available."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateKeyError(FvError, ValueError):
    """Two plugins registered the same key."""


class PluginLoadError(FvError, ImportError):
    """A plugin that a deployment requires failed to load."""


class WeightsError(FvError, ValueError):
    """A checkpoint folder is missing, malformed, or holds pickle files."""


class AdmissionInfeasible(FvError, RuntimeError):
    """A request can never fit the budget; names the resource and the numbers."""


class QueueFull(FvError, RuntimeError):
    """The queue is at its limit; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class StageFailed(FvError, RuntimeError):
    """A workflow's stage failed; the message names the stage and its error."""


class Cancelled(FvError, RuntimeError):
    """A request was cancelled; raised to whoever waits on its result."""


class NonFiniteOutput(FvError, FloatingPointError):
    """A loop produced NaN or infinite outputs; nothing is saved."""


def explain(exc: Any, where: str = "", allowed: Iterable[str] | None = None) -> str:
    """One line per problem of a pydantic (or FastAPI) validation error: the field, the rule, the value,
    the fix. ``where`` prefixes the message (``"deploy.yaml"``, ``"options for plugin 'x'"``);
    ``allowed`` lists the valid top-level field names for unknown top-level fields."""
    lines = []
    for err in exc.errors():
        field = error_field(err) or "(top level)"
        if err["type"] == "extra_forbidden":
            top = len([p for p in err["loc"] if p not in ("body", "query", "path", "header")]) == 1
            known = f" Allowed: {sorted(allowed)}." if allowed is not None and top else ""
            fix = f"it is an unknown field; remove it or check its spelling.{known}"
        elif err["type"] == "missing":
            fix = f"pass {field}."
        else:
            fix = f"give {field} a value that satisfies this."
        got = repr(err.get("input"))
        got = "" if err["type"] == "missing" else f"; got {got if len(got) <= 120 else got[:117] + '...'}"
        lines.append(f"{field}: {err['msg']}{got}. Fix: {fix}")
    head = f"{where}: " if where else ""
    return head + (lines[0] if len(lines) == 1 else "\n  " + "\n  ".join(lines))


def error_field(err: Any) -> str:
    """The dotted field path of one validation error (FastAPI's body/query prefixes dropped)."""
    return ".".join(str(p) for p in err["loc"] if p not in ("body", "query", "path", "header"))
