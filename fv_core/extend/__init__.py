"""Extension seam: observers (read-only) and interceptors (compute-altering)."""

from fv_core.extend.protocols import BaseObserver, BlockInterceptor, Observer, StepInterceptor, plugin_slot

__all__ = ["BaseObserver", "BlockInterceptor", "Observer", "StepInterceptor", "plugin_slot"]
