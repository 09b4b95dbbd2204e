"""fv-wan's training adapter (``fv_core.training.TrainAdapter``): the Wan serve loop's step bodies
over modules a training method chooses, and checkpoints in the diffusers layout.

Conditioning and velocity run ``encode_body``, ``text_kv_body`` and ``denoise_body`` — the bodies
``WanLoop`` serves with — as ``WorkPlan``s under the serve or train profile, so a method's forward is
the server's forward. Text-to-video only (no image conditioning, one expert).

Causal methods (self-forcing) get the causal loop's pieces too: its per-chunk schedule
(:meth:`WanTrainAdapter.causal_schedule`), the prompt's text keys/values (:meth:`WanTrainAdapter.text_kv`)
and one chunk pass (:meth:`WanTrainAdapter.chunk_velocity`) running
``fv_wan.causal_transformer.chunk_body`` over a :class:`ChunkContext`: the rolling window of earlier
chunks' keys/values held in tensors, padded and masked exactly as ``CausalWanLoop`` gathers them from its
KV pool, so a training rollout's chunk forward is the served one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fv_core import ConfigError, LoadedModel
from fv_core.loop import WorkPlan, WorkUnitKind
from fv_core.training import run_body
from fv_core.weights import SHARED_KEY, component_folder
from fv_wan.bodies import decode_body, denoise_body, encode_body, text_kv_body
from fv_wan.causal_transformer import chunk_body, frame_rope
from fv_wan.causal_window import context_frames, evict
from fv_wan.conditioning import encode_condition_body
from fv_wan.samplers import chunk_schedule
from fv_wan.text_cache import clean_prompt
from fv_wan.tiny import word_tokenizer, write_pipeline_files
from fv_wan.transformer import prepare, run_blocks

RECIPE_FILE = "fv_recipe.json"


class WanTrainAdapter:
    """A loaded Wan text-to-video model seen by a training method."""

    def __init__(self, model: LoadedModel, **defaults: Any) -> None:
        variant = model.instance.variant
        if variant.conditioning != "none" or len(variant.experts) > 1:
            raise ConfigError(
                f"{model.card.model_id!r} takes an image or has two experts; training methods run on "
                "text-to-video Wan models with one transformer. Fix: train a Wan2.1 T2V card."
            )
        self.model = model
        # the card's default size and prompt padding, with the method's overrides
        self.defaults = model.prepare({"prompt": "-", **defaults}).params
        self.num_train_timesteps = int(model.instance.scheduler_config["num_train_timesteps"])

    def module(self, name: str) -> torch.nn.Module:
        return self.model.instance.component(name)

    def conditioning(
        self, prompts: list[str], text_encoder: torch.nn.Module | None = None, train: bool = False
    ) -> torch.Tensor:
        enc = self.module("tokenizer")(
            [clean_prompt(p) for p in prompts],
            padding="max_length",
            max_length=self.defaults.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        inputs = {"input_ids": enc.input_ids, "mask": enc.attention_mask}
        encoder = text_encoder if text_encoder is not None else self.module("text_encoder")
        return run_body(_plan(WorkUnitKind.ENCODER_CHUNK, encode_body, encoder, inputs), train)["embeds"]

    def velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: torch.Tensor,
        train: bool = False,
    ) -> torch.Tensor:
        return self._denoise(denoise_body, transformer, latents, sigma, embeds, train)["velocity"]

    def features(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: torch.Tensor,
        train: bool = False,
    ) -> torch.Tensor:
        """Every token's hidden state [B, tokens, dim] after the last block of the denoise forward (what
        a discriminator head on a critic reads)."""
        return self._denoise(features_body, transformer, latents, sigma, embeds, train)["features"]

    def _denoise(self, body: Any, transformer: torch.nn.Module, latents, sigma, embeds, train: bool) -> Any:
        """``body`` (the denoise body or its trunk) at noise level ``sigma`` over the prompt's text K/V."""
        kv = self.text_kv(transformer, embeds, train)
        inputs = {"latents": latents, "timestep": sigma * self.num_train_timesteps, "kv": kv}
        return run_body(_plan(WorkUnitKind.DIFFUSION_STEP, body, transformer, inputs), train)

    # ---- the causal loop's pieces (fv_wan.causal_loop.CausalWanLoop) ----

    def causal_schedule(self, fixed: list[int], shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every chunk's model timesteps [steps] and sigmas [steps + 1] (ending at 0), as the causal loop
        derives them from its card's ``fixed_timesteps`` and the request's ``flow_shift``."""
        return chunk_schedule(fixed, shift, self.num_train_timesteps)

    def text_kv(
        self, transformer: torch.nn.Module, embeds: torch.Tensor, train: bool = False
    ) -> torch.Tensor:
        """Every block's cross-attention keys/values of ``embeds`` (the loop's ``text_kv_body``)."""
        return run_body(
            _plan(WorkUnitKind.ENCODER_CHUNK, text_kv_body, transformer, {"text": embeds}), train
        )["kv"]

    def chunk_context(
        self, transformer: torch.nn.Module, latents: torch.Tensor, window: int, sink: int
    ) -> ChunkContext:
        """An empty rolling window of ``transformer``'s keys/values for a rollout of ``latents``
        [B, C, F, H, W] (``window`` latent frames at most, the first ``sink`` always kept)."""
        _, p_h, p_w = self.model.instance.variant.patch
        config: Any = transformer.config
        return ChunkContext(
            window=window,
            sink=sink,
            tokens_per_frame=(latents.shape[3] // p_h) * (latents.shape[4] // p_w),
            shape=(int(config.num_layers), int(config.num_attention_heads), int(config.attention_head_dim)),
        )

    def chunk_velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: float,
        kv: torch.Tensor,
        context: ChunkContext,
        first_frame: int,
        train: bool = False,
    ) -> dict[str, torch.Tensor]:
        """One pass of the chunk ``latents`` [B, C, n, H, W] (latent frames ``first_frame ..``) at model
        ``timestep`` over ``context``: the causal loop's chunk body with the inputs its ``_chunk_plan``
        builds. Returns the velocity and the chunk's keys/values (what a cache write stores)."""
        cos, sin = frame_rope(transformer, first_frame, latents.shape[2], latents.shape[3], latents.shape[4])
        rows = latents.shape[0]
        inputs = {
            "latents": latents.to(self.model.instance.dtype),
            "timestep": torch.full((rows,), timestep, dtype=torch.float32, device=latents.device),
            "kv": kv,
            "rope_cos": cos,
            "rope_sin": sin,
            **context.gather(rows, self.model.instance.dtype),
        }
        return run_body(_plan(WorkUnitKind.DIFFUSION_STEP, chunk_body, transformer, inputs), train)

    def noise(self, batch: int, generator: torch.Generator, **params: Any) -> torch.Tensor:
        p, v = self.defaults.model_copy(update=params), self.model.instance.variant
        shape = (
            batch,
            v.latent_channels,
            (p.num_frames - 1) // v.temporal_scale + 1,
            p.height // v.spatial_scale,
            p.width // v.spatial_scale,
        )
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        plan = _plan(WorkUnitKind.VAE_TILE, encode_condition_body, self.module("vae"), {"video": video})
        return run_body(plan, False)["latents"]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        plan = _plan(WorkUnitKind.VAE_TILE, decode_body, self.module("vae"), {"latents": latents})
        return run_body(plan, False)["frames"]

    def export(self, folder: Path, modules: dict[str, torch.nn.Module], recipe: dict[str, Any]) -> None:
        """Self-contained: components a source student shares with its parent are copied in."""
        folder, source = Path(folder), Path(self.model.weights)
        shutil.copytree(source, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns(RECIPE_FILE))
        index = json.loads((folder / "model_index.json").read_text())
        for name in index.pop(SHARED_KEY, {}):
            shutil.copytree(component_folder(source, name), folder / name, dirs_exist_ok=True)
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        for name, module in modules.items():
            shutil.rmtree(folder / name, ignore_errors=True)
            module.save_pretrained(folder / name, safe_serialization=True)
        (folder / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")

    @staticmethod
    def init_checkpoint(
        folder: Path,
        transformer: dict[str, Any],
        text_encoder: dict[str, Any],
        vocabulary: list[str],
        vae: Path,
    ) -> None:
        """A freshly initialised Wan2.1 T2V checkpoint: ``transformer`` (WanTransformer3DModel config)
        and ``text_encoder`` (UMT5 config) from the global RNG, a word-level tokenizer over
        ``vocabulary``, and the trained ``vae`` folder copied in."""
        from diffusers import WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
        for word in vocabulary:
            vocab.setdefault(word, len(vocab))
        config = UMT5Config(
            vocab_size=len(vocab), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **text_encoder
        )
        if transformer.get("text_dim") != config.d_model:
            raise ConfigError(
                f"transformer.text_dim={transformer.get('text_dim')} must equal text_encoder.d_model="
                f"{config.d_model}. Fix: set them equal."
            )
        folder = Path(folder)
        WanTransformer3DModel(**transformer).save_pretrained(folder / "transformer", safe_serialization=True)
        UMT5EncoderModel(config).save_pretrained(folder / "text_encoder", safe_serialization=True)
        word_tokenizer(vocab).save_pretrained(folder / "tokenizer")
        shutil.copytree(vae, folder / "vae", dirs_exist_ok=True)
        write_pipeline_files(folder)


@dataclass
class ChunkContext:
    """A training rollout's cached keys/values of its finished chunks, in tensors: the twin of a causal
    request's KV-pool sequence (same rolling window, same padding to a power-of-two number of frames)."""

    window: int  # latent frames held at most
    sink: int  # first latent frames always kept
    tokens_per_frame: int
    shape: tuple[int, int, int]  # blocks, heads, head_dim of the transformer's keys/values
    frames: list[int] = field(default_factory=list)  # the latent frames held, in order
    k: torch.Tensor | None = None  # [B, blocks, heads, tokens, head_dim]
    v: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, first_frame: int) -> None:
        """Append a chunk's keys/values (latent frames ``first_frame ..``) after dropping, as the loop's
        cache write does, the oldest frames after the sinks that the window has no room for."""
        n, tpf = k.shape[3] // self.tokens_per_frame, self.tokens_per_frame
        kept, dropped = evict(self.frames, n, self.window, self.sink)
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        else:
            if dropped:
                start = self.frames.index(dropped[0]) * tpf
                end = start + len(dropped) * tpf
                self.k = torch.cat([self.k[:, :, :, :start], self.k[:, :, :, end:]], 3)
                self.v = torch.cat([self.v[:, :, :, :start], self.v[:, :, :, end:]], 3)
            self.k, self.v = torch.cat([self.k, k], 3), torch.cat([self.v, v], 3)
        self.frames = kept + list(range(first_frame, first_frame + n))

    def gather(self, rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``ctx_k`` / ``ctx_v`` [rows, blocks, heads, size, head_dim] zero past the held tokens and
        ``ctx_valid`` [rows, size], ``size`` the loop's padded context (``context_frames``)."""
        size = context_frames(len(self.frames), self.window) * self.tokens_per_frame
        blocks, heads, dim = self.shape
        out_k = torch.zeros(rows, blocks, heads, size, dim, dtype=dtype)
        out_v = torch.zeros(rows, blocks, heads, size, dim, dtype=dtype)
        length = 0 if self.k is None or self.v is None else self.k.shape[3]
        if self.k is not None and self.v is not None:
            out_k[:, :, :, :length], out_v[:, :, :, :length] = self.k, self.v
        valid = (torch.arange(size) < length)[None].expand(rows, size)
        return {"ctx_k": out_k, "ctx_v": out_v, "ctx_valid": valid}


def features_body(transformer: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """The denoise body's forward up to its output head: the hidden states after the last block."""
    prep = prepare(transformer, inputs["latents"], inputs["timestep"], inputs["kv"])
    return {"features": run_blocks(transformer, prep)}


def _plan(kind: WorkUnitKind, body: Any, module: torch.nn.Module, inputs: dict[str, Any]) -> WorkPlan:
    """A plan of one of the Wan loop's own step bodies over ``module``."""
    rows = next(v.shape[0] for v in inputs.values())
    return WorkPlan(
        kind=kind, body=partial(body, module), inputs=inputs, batch_size=rows, label=body.__name__
    )


__all__ = ["ChunkContext", "WanTrainAdapter"]
