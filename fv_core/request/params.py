"""Typed request parameters: each loop declares one ``Params`` model, the card holds its defaults.

A field's ``json_schema_extra`` may carry two keys the front door reads:

- ``"limit"``: the deploy ``Limits`` field that caps it (``{"limit": "max_frames"}``);
- ``"cli"``: extra ``fv generate`` flag names (``{"cli": ["--steps"]}``).

Families subclass :class:`Params`, add their fields with ranges and descriptions, and put
rules that need the card (its step contract, samplers, sizes) in :meth:`Params.check`.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from fv_core.card.spec import ModelCard

MAX_SEED = 2**63 - 1


class Params(BaseModel):
    """Base of every loop's request parameters: unknown fields are errors, values are final."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, validate_default=True)

    seed: int = Field(0, ge=0, le=MAX_SEED, description="seeds the request's noise; same seed, same output")

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, data: Any) -> Any:
        return refuse_booleans(cls, data)

    def check(self, card: ModelCard, loop_id: str) -> None:
        """Rules that depend on ``card`` (raise ConfigError naming the value, the rule and the fix)."""


def refuse_booleans(model: type[BaseModel], data: Any) -> Any:
    """Raise for ``true``/``false`` given to a number field (pydantic would read them as 1 and 0)."""
    if isinstance(data, dict):
        for name, value in data.items():
            info = model.model_fields.get(name)
            kinds = {info.annotation, *typing.get_args(info.annotation)} if info is not None else set()
            if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
                raise ValueError(f"{name}={value!r} is a boolean; {name} takes a number. Fix: send a number")
    return data


def param_meta(limit: str | None = None, *cli: str) -> dict[str, Any]:
    """A Params field's ``json_schema_extra``: the deploy limit that caps it, extra CLI flag names."""
    return {"limit": limit, "cli": list(cli)}


def field_extra(params: type[BaseModel], name: str, key: str, default: Any = None) -> Any:
    """``json_schema_extra[key]`` of field ``name`` (``default`` when absent)."""
    extra = params.model_fields[name].json_schema_extra
    return extra.get(key, default) if isinstance(extra, dict) else default


def schema_with_defaults(params: type[BaseModel], defaults: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of ``params`` with a card's ``defaults`` written into its properties."""
    schema = params.model_json_schema()
    for name, value in defaults.items():
        if name in schema.get("properties", {}):
            schema["properties"][name]["default"] = value
    schema["required"] = [r for r in schema.get("required", []) if r not in defaults]
    return schema
