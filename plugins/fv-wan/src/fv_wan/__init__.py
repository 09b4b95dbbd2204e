"""fv-wan: Wan2.1 text-to-video and FastWan cards for fv."""

from fv_wan.generate import card, generate, load

__all__ = ["card", "generate", "load"]
