"""Typed request parameters: each loop declares one ``Params`` model, the card holds its defaults.

A field's ``json_schema_extra`` may carry two keys the front door reads:

- ``"limit"``: the deploy ``Limits`` field that caps it (``{"limit": "max_frames"}``);
- ``"cli"``: extra ``fv generate`` flag names (``{"cli": ["--steps"]}``).

Families subclass :class:`Params`, add their fields with ranges and descriptions, and put
rules that need the card (its step contract, samplers, sizes) in :meth:`Params.check`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from fv_core.card.spec import ModelCard

MAX_SEED = 2**63 - 1


class Params(BaseModel):
    """Base of every loop's request parameters: unknown fields are errors, values are final."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, validate_default=True)

    seed: int = Field(0, ge=0, le=MAX_SEED, description="seeds the request's noise; same seed, same output")

    def check(self, card: ModelCard, loop_id: str) -> None:
        """Rules that depend on ``card`` (raise ConfigError naming the value, the rule and the fix)."""


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
