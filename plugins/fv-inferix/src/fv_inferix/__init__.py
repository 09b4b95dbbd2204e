"""fv-inferix: Inferix-style KV management for block-causal loops (local + retrieved global blocks)."""

from fv_inferix.options import PLUGIN, InferixOptions
from fv_inferix.policy import Inferix

__all__ = ["PLUGIN", "Inferix", "InferixOptions"]
