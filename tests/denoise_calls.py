"""An observer the packing and batching tests share."""

from __future__ import annotations


class DenoiseCalls:
    """How many plans each denoise step shared its call with, in order."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_step(self, state, plan, result) -> None:
        if plan.label.startswith("denoise"):
            self.sizes.append(result.batched_with)
