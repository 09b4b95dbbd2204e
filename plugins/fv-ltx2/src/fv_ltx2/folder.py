"""LTX-2 checkpoint folders (``model_index.json`` class ``LTX2Pipeline``): a card from the folder's own
configs, so ``fv_core.load("/models/LTX-2")`` works without naming a card; a named card states the
folder it runs on the same way."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fv_core.card import ModelCard, StepCostModel
from fv_ltx2.cards import BASE_RECIPE, CLASSES, ltx2_card


def architecture(folder: Path) -> dict[str, dict]:
    """What a card states about ``folder``, the values requests are checked against
    (:class:`fv_ltx2.params.Geometry`): the video VAE's compression and the audio VAE's sampling, as
    diffusers' classes make them of the folder's configs (built on the meta device: no weights read)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video

    def built(cls, name: str):
        with torch.device("meta"):
            return cls.from_config(json.loads((folder / name / "config.json").read_text()))

    vae, audio_vae = built(AutoencoderKLLTX2Video, "vae"), built(AutoencoderKLLTX2Audio, "audio_vae")
    return {
        "vae": {
            "temporal_compression_ratio": vae.temporal_compression_ratio,
            "spatial_compression_ratio": vae.spatial_compression_ratio,
        },
        "audio_vae": {k: audio_vae.config[k] for k in ("sample_rate", "mel_hop_length")},
    }


class LTX2Folder:
    """The ``LTX2Pipeline`` reader (``fv_register_pipelines``)."""

    @staticmethod
    def card(folder: Path) -> ModelCard:
        """A card for the LTX-2 in ``folder``: diffusers' LTX2Pipeline defaults, STG on block 28 (or its last
        block when it has fewer)."""
        dit = json.loads((folder / "transformer" / "config.json").read_text())
        blocks = dit["num_layers"]
        config = {**CLASSES, "transformer": {**CLASSES["transformer"], "num_layers": blocks}}
        return LTX2Folder.bind(
            ltx2_card(
                f"ltx2:{folder.name}",
                f"LTX-2 checkpoint at {folder} ({blocks} blocks); card built from its configs.",
                BASE_RECIPE,
                StepCostModel(base_s=1e-3 * blocks, per_token_s=1e-6 * blocks),
                defaults={"spatio_temporal_guidance_blocks": [min(28, blocks - 1)]},
                config=config,
            ),
            folder,
        )

    @staticmethod
    def bind(card: ModelCard, folder: Path) -> ModelCard:
        """``card`` stating the folder's frame and audio rules (:func:`architecture`); its other configs were
        checked against the card."""
        card = card.model_copy(deep=True)
        for name, values in architecture(folder).items():
            card.components[name].config.update(values)
        return card
