"""BAGEL checkpoints in their published layout (ByteDance-Seed/BAGEL-7B-MoT), unchanged:

  ema.safetensors    the MoT language model, generation heads, SigLIP tower, connector, tables
  ae.safetensors     the FLUX autoencoder (Black Forest Labs' key names)
  llm_config.json    Qwen2 config of the decoder
  vit_config.json    SigLIP config of the tower (BAGEL runs one layer fewer than it lists)
  tokenizer.json / vocab.json + merges.txt, tokenizer_config.json   the Qwen2 tokenizer

Only safetensors are read; a folder holding pickle files is refused before anything is read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from fv_core import WeightsError
from fv_core.weights import refuse_pickles

LAYOUT = """\
  ema.safetensors   llm_config.json   vit_config.json   ae.safetensors
  tokenizer.json (or vocab.json + merges.txt) and tokenizer_config.json"""
REQUIRED = ("ema.safetensors", "llm_config.json", "vit_config.json", "tokenizer_config.json")
# llm_config.json keys that are BAGEL's own or the training run's, not Qwen2Config's
BAGEL_LLM_KEYS = {
    "architectures", "transformers_version", "qk_norm", "layer_module", "freeze_und", "_attn_implementation",
    "attn_implementation", "is_causal", "torch_dtype", "dtype",
}  # fmt: skip
TABLES = {"latent_pos_embed": 64, "vit_pos_embed": 70}  # BAGEL's max_latent_size, vit_max_num_patch_per_side
SPECIAL_TOKENS = {  # BAGEL's new_token_ids: name -> token (Qwen2.5's own special tokens)
    "bos_token_id": "<|im_start|>",
    "eos_token_id": "<|im_end|>",
    "start_of_image": "<|vision_start|>",
    "end_of_image": "<|vision_end|>",
}


def _fail(folder: Path, problem: str) -> None:
    raise WeightsError(
        f"{problem} (in {str(folder)!r}). A BAGEL checkpoint is the published folder:\n{LAYOUT}\n"
        "Fix: point --weights at such a folder (e.g. a download of ByteDance-Seed/BAGEL-7B-MoT)."
    )


def check_layout(folder: str | Path, vae: bool = False) -> Path:
    """The folder as a Path once it holds the published files (``ae.safetensors`` too with ``vae``)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        _fail(folder, "weights folder does not exist")
    refuse_pickles(folder)
    for name in (*REQUIRED, *(("ae.safetensors",) if vae else ())):
        if not (folder / name).is_file():
            _fail(folder, f"{name} is missing")
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        _fail(folder, "neither tokenizer.json nor vocab.json + merges.txt is there")
    return folder


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(
            f"{str(path)!r} is not valid JSON ({exc}). Fix: repair or re-download it."
        ) from None


def llm_config(folder: Path) -> Any:
    """The decoder's Qwen2 config as BAGEL runs it (q/k norm on, untied head)."""
    from transformers import Qwen2Config

    data = read_json(folder / "llm_config.json")
    if (
        data.get("qk_norm") is False
        or data.get("layer_module", "Qwen2MoTDecoderLayer") != "Qwen2MoTDecoderLayer"
    ):
        _fail(folder, f"llm_config.json describes qk_norm={data.get('qk_norm')!r}, layer_module="
              f"{data.get('layer_module')!r}; fv runs BAGEL's MoT (qk_norm on, Qwen2MoTDecoderLayer)")  # fmt: skip
    data.update(tie_word_embeddings=False)
    return Qwen2Config(**{k: v for k, v in data.items() if k not in BAGEL_LLM_KEYS})


def vit_config(folder: Path) -> Any:
    """The SigLIP config as BAGEL runs it: no RoPE, one layer fewer than the file lists."""
    from transformers import SiglipVisionConfig

    data = read_json(folder / "vit_config.json")
    data["num_hidden_layers"] = int(data["num_hidden_layers"]) - 1
    config = SiglipVisionConfig(**{k: v for k, v in data.items() if k not in ("architectures", "rope")})
    config._attn_implementation = "sdpa"
    return config


def safetensors_header(path: Path) -> dict[str, Any]:
    """Each tensor's ``dtype`` and ``shape`` from a safetensors header (nothing else is read)."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {k: v for k, v in header.items() if k != "__metadata__"}


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape from a safetensors header."""
    return {k: v["shape"] for k, v in safetensors_header(path).items()}


def table_sides(shapes: dict[str, list[int]]) -> dict[str, int]:
    """The sides of the frozen sin-cos position tables: from the file when it holds them, else BAGEL's
    (app.py)."""
    return {
        name: math.isqrt(shapes[f"{name}.pos_embed"][0]) if f"{name}.pos_embed" in shapes else default
        for name, default in TABLES.items()
    }


def load_net(folder: Path, dtype: torch.dtype, device: torch.device) -> Any:
    """``BagelNet`` with every tensor of ``ema.safetensors`` (strict: none missing but the two frozen
    sin-cos position tables, which are computed when left out; none left over)."""
    from safetensors.torch import load_file

    from fv_bagel.net import BagelNet

    shapes = tensor_shapes(folder / "ema.safetensors")
    if "vae2llm.weight" not in shapes:
        raise WeightsError(
            f"ema.safetensors in {str(folder)!r} has no 'vae2llm.weight': not a BAGEL MoT checkpoint. "
            "Fix: use BAGEL-7B-MoT's ema.safetensors."
        )
    latent_dim = shapes["vae2llm.weight"][1]
    sides = table_sides(shapes)
    llm, vit = llm_config(folder), vit_config(folder)
    with torch.device("meta"):
        net = BagelNet(
            llm, vit, latent_channels=latent_dim // 4, max_latent_size=sides["latent_pos_embed"],
            vit_side=sides["vit_pos_embed"],
        )  # fmt: skip
    state = load_file(str(folder / "ema.safetensors"), device=str(device))
    missing, unexpected = net.load_state_dict(state, strict=False, assign=True)
    tables = {f"{name}.pos_embed" for name in TABLES}
    if set(missing) - tables or unexpected:
        raise WeightsError(
            f"ema.safetensors in {str(folder)!r} does not fit its configs: missing {sorted(missing)[:6]}, "
            f"unexpected {sorted(unexpected)[:6]}. Fix: keep ema.safetensors, llm_config.json and "
            "vit_config.json from the same BAGEL checkpoint."
        )
    from fv_bagel.mot import PositionEmbedding, sincos_2d

    for key in missing:  # a table the file leaves out is computed, as BAGEL initialises it
        module = net.get_submodule(key.rsplit(".", 1)[0])
        assert isinstance(module, PositionEmbedding)
        module.pos_embed = torch.nn.Parameter(
            sincos_2d(llm.hidden_size, module.side).to(device), requires_grad=False
        )
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    with torch.device(device):  # its inv_freq buffer is not in the file: computed again off meta
        net.language_model.model.rotary_emb = Qwen2RotaryEmbedding(config=llm)
    return net.to(dtype=dtype).eval()


def load_tokenizer(folder: Path) -> tuple[Any, dict[str, int]]:
    """The Qwen2 tokenizer and BAGEL's special token ids (each must be in its vocabulary)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids: dict[str, Any] = {
        name: tokenizer.convert_tokens_to_ids(token) for name, token in SPECIAL_TOKENS.items()
    }
    unknown = [
        SPECIAL_TOKENS[n] for n, i in ids.items() if not isinstance(i, int) or i == tokenizer.unk_token_id
    ]
    if unknown:
        _fail(folder, f"the tokenizer lacks BAGEL's special tokens {unknown}")
    return tokenizer, ids
