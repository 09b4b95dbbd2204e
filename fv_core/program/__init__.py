"""Programs: loops of one card composed against one shared instance."""

from fv_core.program.program import Bind, Program, Stage

__all__ = ["Bind", "Program", "Stage"]
