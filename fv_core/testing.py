"""Parity base test classes a model plugin's tests subclass (the card contract, shared by every family).

A subclass provides three pytest fixtures and inherits the tests::

    class TestMyCard(CardContract):
        @pytest.fixture
        def contract_model(self, ...) -> LoadedModel: ...        # fv_core.load(...) of the card
        @pytest.fixture
        def contract_reference(self, ...): ...                    # params -> frames [F, H, W, 3] or
                                                                  # {"frames": ..., "audio": [ch, samples]}
        @pytest.fixture
        def contract_requests(self) -> list[dict]: ...            # params of a few different requests

``test_c1_matches_the_reference``: each request's output equals the reference pipeline's (e.g.
diffusers on the same weights and seed) within the card's ``parity.tolerances["frames"]``.
``test_interleave_gate``: the requests interleaved step by step equal them run serially, bit for bit.
``test_card_defaults_are_honoured``: a request that sets only ``prompt`` runs at the card's defaults
(``contract_affordable`` may set a few more, e.g. a small size for a card whose default size is slow).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fv_core.artifacts import ImageArtifact, VideoArtifact
from fv_core.model import LoadedModel
from fv_core.parity.gate import assert_interleave_parity
from fv_core.runtime.engine import Engine

__all__ = ["CardContract"]

# params -> the reference's frames [F, H, W, 3], or {"frames": ..., "audio": [channels, samples]}
Reference = Callable[[dict[str, Any]], Any]


class CardContract:
    """The tests every card passes; see the module docstring for the fixtures a subclass provides."""

    contract_affordable: dict[str, Any] = {}  # params set over the defaults to keep a run cheap (e.g. size)
    contract_parts: dict[str, Callable[[], list]] = {}  # task -> its input parts (tasks that take some)

    def test_c1_matches_the_reference(
        self, contract_model: LoadedModel, contract_reference: Reference, contract_requests: list[dict]
    ) -> None:
        tolerances = contract_model.card.parity.tolerances
        for params in contract_requests:
            ours = contract_model.generate(**params)
            ref = contract_reference(ours.provenance["params"])  # every resolved param, defaults included
            ref = ref if isinstance(ref, dict) else {"frames": ref}
            mine = {"frames": _frames(ours), "audio": getattr(getattr(ours, "audio", None), "samples", None)}
            for output, expected in ref.items():
                got = mine[output]
                assert got is not None and got.shape == expected.shape, (params, output, expected.shape)
                worst = float(np.abs(got - expected).max())
                allowed = tolerances.get(output, 0.0)
                assert worst <= allowed, (
                    f"{params}: {output} max |fv - reference| = {worst:.3e} > {allowed:g}"
                )

    def test_interleave_gate(self, contract_model: LoadedModel, contract_requests: list[dict]) -> None:
        def items() -> list[Any]:
            return [
                contract_model.job(contract_model.prepare(p, request_id=f"r{i}"))
                for i, p in enumerate(contract_requests)
            ]

        report = assert_interleave_parity(Engine, items)
        assert report.ok and report.max_abs == 0.0

    def test_card_defaults_are_honoured(
        self, contract_model: LoadedModel, contract_requests: list[dict]
    ) -> None:
        """A prompt-only request resolves to the card's defaults and runs them: the same output as the
        request with every default spelled out, and the default step count."""
        card = contract_model.card
        for task, program in card.programs.items():
            asked = {"prompt": contract_requests[0]["prompt"], **self.contract_affordable}
            parts = self.contract_parts[task]() if task in self.contract_parts else []
            assumed = contract_model.generate(task=task, parts=parts, **asked)
            resolved = assumed.provenance["params"]
            assert resolved == {**resolved, **program.defaults, **asked}, (card.model_id, task)
            spelled = contract_model.generate(task=task, parts=parts, **resolved)
            assert np.array_equal(_frames(assumed), _frames(spelled))
            if "num_inference_steps" in resolved and len(program.stages) == 1:
                assert assumed.provenance["metrics"]["steps"] == resolved["num_inference_steps"]


def _frames(artifact: Any) -> np.ndarray:
    if isinstance(artifact, ImageArtifact):
        return artifact.image[None]
    assert isinstance(artifact, VideoArtifact), "the card contract compares video or image outputs"
    return artifact.frames
