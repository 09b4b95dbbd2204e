"""Options of fv-inferix, per deployment and per request.

Example (deploy YAML)::

    plugins: [fv-wan, fv-inferix]
    models:
      - card: wan2.1-t2v-shapes-causal
        interceptors: [inferix]
    plugin_options:
      fv-inferix: {local_blocks: 1, global_blocks: 1}

The memory budget is the request's own ``window_frames`` (what admission reserves pages for): the
cache never holds more, and when a new block needs room the least relevant block leaves, not the
oldest. Sink blocks (those holding the first ``sink_frames``) always stay and are always attended.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

PLUGIN = "fv-inferix"


class InferixOptions(BaseModel):
    """Options of plugin fv-inferix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True  # False: this request keeps the loop's rolling window (attends all it caches)
    local_blocks: int = Field(1, ge=1, le=64)  # most recent cached blocks every new block attends to
    global_blocks: int = Field(1, ge=0, le=1024)  # earlier blocks each layer retrieves by relevance
    relevance_decay: float = Field(0.9, gt=0.0, le=1.0)  # per pass: a block's relevance is a decayed sum
