"""Wan checkpoints in the published diffusers layout: check, fingerprint, load.

Only safetensors (sharded or not) are accepted; pickle files are refused
before anything is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fv_core import WeightsError
from fv_core.weights import FROM_PRETRAINED_LOCK, component_folder, refuse_pickles

EXPECTED_LAYOUT = """\
  model_index.json
  transformer/   config.json + diffusion_pytorch_model.safetensors (or *.safetensors.index.json + shards)
  vae/           config.json + diffusion_pytorch_model.safetensors
  text_encoder/  config.json + model.safetensors (or model.safetensors.index.json + shards)   [UMT5]
  tokenizer/     tokenizer_config.json + tokenizer.json (or spiece.model)
  scheduler/     scheduler_config.json
and, where model_index.json lists them (Wan2.1 I2V; Wan2.2 A14B):
  image_encoder/    config.json + model.safetensors   [CLIP vision]
  image_processor/  preprocessor_config.json
  transformer_2/    like transformer/ (the low-noise expert)
A distilled student may ship only its transformer/: model_index.json's "_fv_shared" then maps each
component it shares with its parent to that folder, relative to this one ({"vae": "../shapes/vae"})."""

WEIGHT_FOLDERS = ("transformer", "vae", "text_encoder")
BASE_COMPONENTS = [*WEIGHT_FOLDERS, "tokenizer", "scheduler"]
OPTIONAL_COMPONENTS = ("transformer_2", "image_encoder", "image_processor")

# component name -> (library, class) used to load it
COMPONENT_CLASSES = {
    "transformer": ("diffusers", "WanTransformer3DModel"),
    "transformer_2": ("diffusers", "WanTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLWan"),
    "text_encoder": ("transformers", "UMT5EncoderModel"),
    "tokenizer": ("transformers", "AutoTokenizer"),
    "image_encoder": ("transformers", "CLIPVisionModel"),
    "image_processor": ("transformers", "CLIPImageProcessor"),
}
# classes model_index.json may name instead (diffusers loads the one it names)
ALTERNATIVE_CLASSES = {
    "image_encoder": {"CLIPVisionModel", "CLIPVisionModelWithProjection"},
    "image_processor": {"CLIPImageProcessor", "CLIPImageProcessorPil", "CLIPImageProcessorFast"},
}


def pipeline_index(folder: Path) -> dict[str, Any]:
    """``model_index.json`` of a checkpoint folder."""
    return json.loads((folder / "model_index.json").read_text())


def component_dir(folder: Path, name: str) -> Path:
    """Where component ``name`` of the checkpoint ``folder`` lives (``fv_core.weights.component_folder``:
    its own subfolder, or a parent's it shares)."""
    return component_folder(folder, name)


def listed_components(folder: Path) -> list[str]:
    """The base components plus the optional ones ``model_index.json`` lists (not ``[null, null]``)."""
    index = pipeline_index(folder)
    return BASE_COMPONENTS + [n for n in OPTIONAL_COMPONENTS if (index.get(n) or [None])[0] is not None]


def _fail(folder: Path, problem: str) -> None:
    raise WeightsError(
        f"{problem} (in {str(folder)!r}). A Wan checkpoint is a diffusers-format folder:\n{EXPECTED_LAYOUT}\n"
        "Fix: point --weights at such a folder (e.g. a download of Wan-AI/Wan2.1-T2V-1.3B-Diffusers)."
    )


def check_layout(folder: str | Path, components: list[str] | None = None) -> Path:
    """Validate the folder (or just ``components`` of it); return it as a Path.

    Raises ``WeightsError`` naming what is wrong and listing the expected layout.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        _fail(folder, "weights folder does not exist")
    refuse_pickles(folder)
    index = folder / "model_index.json"
    if not index.is_file():
        _fail(folder, "model_index.json is missing")
    try:
        json.loads(index.read_text())
    except json.JSONDecodeError as exc:
        _fail(folder, f"model_index.json is not valid JSON ({exc})")
    for name in components or listed_components(folder):
        _check_component(folder, name)
    return folder


def _check_component(folder: Path, name: str) -> None:
    sub = component_dir(folder, name)
    name = Path(name).name  # a card's subfolder path names the component last
    if sub.resolve() != (folder / name).resolve():
        refuse_pickles(sub)  # a shared folder outside this checkpoint
    if not sub.is_dir():
        _fail(folder, f"component folder {name}/ is missing")
    if name == "scheduler":
        if not (sub / "scheduler_config.json").is_file():
            _fail(folder, "scheduler/scheduler_config.json is missing")
        return
    if name == "tokenizer":
        if not any((sub / f).is_file() for f in ("tokenizer.json", "spiece.model")):
            _fail(folder, "tokenizer/ has neither tokenizer.json nor spiece.model")
        return
    if name == "image_processor":
        if not (sub / "preprocessor_config.json").is_file():
            _fail(folder, "image_processor/preprocessor_config.json is missing")
        return
    if not (sub / "config.json").is_file():
        _fail(folder, f"{name}/config.json is missing")
    if not list(sub.glob("*.safetensors")):
        _fail(folder, f"{name}/ holds no *.safetensors weights")
    for index in sub.glob("*.safetensors.index.json"):
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (sub / s).is_file())
        if missing:
            _fail(folder, f"{name}/{index.name} names missing shards {missing}")


def load_component(folder: str | Path, name: str, dtype: torch.dtype = torch.float32) -> Any:
    """Load one component with its library's ``from_pretrained`` (safetensors only)."""
    folder = check_layout(folder, [name])
    sub, name = component_dir(folder, name), Path(name).name
    library, cls_name = COMPONENT_CLASSES[name]
    if name in ALTERNATIVE_CLASSES:
        listed = (pipeline_index(folder).get(name) or [None, None])[1] or cls_name
        if listed not in ALTERNATIVE_CLASSES[name]:
            _fail(
                folder,
                f"model_index.json names {listed!r} for {name}; fv loads {sorted(ALTERNATIVE_CLASSES[name])}",
            )
        cls_name = listed
    with FROM_PRETRAINED_LOCK:  # loads on two threads (a weight sync staging) must not interleave
        if library == "diffusers":
            import diffusers

            cls = getattr(diffusers, cls_name)
            return cls.from_pretrained(sub, torch_dtype=dtype, use_safetensors=True).eval()
        import transformers

        cls = getattr(transformers, cls_name)
        if name in ("tokenizer", "image_processor"):
            return cls.from_pretrained(sub)
        return cls.from_pretrained(sub, dtype=dtype, use_safetensors=True).eval()


def load_scheduler_config(folder: str | Path) -> dict[str, Any]:
    """The checkpoint's ``scheduler/scheduler_config.json``."""
    folder = check_layout(folder, ["scheduler"])
    return json.loads((component_dir(folder, "scheduler") / "scheduler_config.json").read_text())
