"""BAGEL folders loaded by path: ``fv_core.load("/models/BAGEL-7B-MoT")``.

The published layout has no ``model_index.json``: the reader recognises it by its files and builds a
card from its configs and tables, with BAGEL's published defaults bounded by what the folder holds (the
image sizes by its latent table, the ViT transform by its tower's patch and table).
"""

from __future__ import annotations

from pathlib import Path

from fv_bagel.cards import bagel_card
from fv_bagel.checkpoint import check_layout, llm_config, safetensors_header, table_sides, vit_config
from fv_bagel.params import VAE_TRANSFORM
from fv_core.card import ModelCard, PrecisionContract, StepCostModel

FILES = ("ema.safetensors", "llm_config.json", "vit_config.json")  # what marks the layout
DOWN = 16  # pixels a latent patch: the FLUX VAE's x8, 2x2 patches
KV_TOKENS = 1 << 17  # tokens of keys/values the card budgets (BAGEL-7B-MoT: 7 GiB in bfloat16)
STORED = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}  # safetensors dtype -> torch's
SEVEN_B = 28 * 3584  # BAGEL-7B-MoT's layers x width: the step cost scales from its


class BagelFolder:
    """The reader of BAGEL folders (``fv_register_pipelines`` key ``Bagel``, BAGEL's model class)."""

    @staticmethod
    def recognizes(folder: Path) -> bool:
        """A folder in BAGEL's published layout (the decoder's and tower's configs beside the EMA weights)."""
        return all((folder / name).is_file() for name in FILES)

    @staticmethod
    def card(folder: Path) -> ModelCard:
        """A card for the BAGEL the folder holds, running in the precision its weights are stored in."""
        check_layout(folder)
        llm, vit = llm_config(folder), vit_config(folder)
        header = safetensors_header(folder / "ema.safetensors")
        sides = table_sides({k: v["shape"] for k, v in header.items()})
        stored = STORED.get(header.get("vae2llm.weight", {}).get("dtype"), "float32")
        side = sides["latent_pos_embed"] * DOWN  # the largest image, px a side
        most = min(VAE_TRANSFORM[0], side)
        p = vit.patch_size
        vit_most = sides["vit_pos_embed"] * p
        layers, width = llm.num_hidden_layers, llm.hidden_size
        head_dim = getattr(llm, "head_dim", None) or width // llm.num_attention_heads
        itemsize = 2 if stored in ("bfloat16", "float16") else 4
        scale = layers * width / SEVEN_B
        return bagel_card(
            f"bagel:{folder.name}",
            f"BAGEL checkpoint at {folder} ({layers} layers, width {width}, latent table {side} px a side, "
            f"stored in {stored}); card built from its configs.",
            StepCostModel(
                base_s=0.02 * scale, per_token_s=2e-5 * scale, peak_bytes_per_token=int(400_000 * scale)
            ),
            t2i=dict(height=min(1024, side), width=min(1024, side)),
            precision=PrecisionContract(supported=sorted({stored, "bfloat16", "float32"}), default=stored),
            transforms=dict(
                vae_transform=(most, min(VAE_TRANSFORM[1], most // 2), DOWN),
                vit_transform=(vit_most, min(16 * p, vit_most // 2), p),  # BAGEL-7B-MoT: (980, 224, 14)
            ),
            max_resolution=(side, side),
            kv_bytes=layers * llm.num_key_value_heads * head_dim * 2 * itemsize * KV_TOKENS,
        )
