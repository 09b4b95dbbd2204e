"""The ``flow`` method: plain flow-matching training of a Wan checkpoint on the serve step bodies.

Per step: encode clips with the frozen VAE (normalised as the serve loop's decode un-normalises),
draw a shifted sigma per clip, noise ``x_t = (1 - s) x0 + s eps`` and regress the transformer's
velocity on ``eps - x0``. The model is loaded with ``fv_core.load`` and every forward goes through
its family's training adapter (``fv_core.training.train_adapter``), which runs the serve loop's own
step bodies under the train profile: no second forward, and no import of the family plugin.
Captions are dropped to "" at ``caption_dropout`` so classifier-free guidance has an unconditional
branch. Roles: the student (the loaded model's own modules) is optimised (AdamW, grad clipping); an
EMA copy is what evaluation and the export use.

With ``lora_rank`` only LoRA pairs train (``fv_core.adapters.TrainableLora``): they are registered on
the loaded model's adapter plane and applied by its per-row hooks around the same serve bodies, so the
training forward is what a request naming the exported adapter runs; the base transformer and the text
encoder stay frozen. The student and the EMA are then the pairs (on the shared base), and the export is
diffusers' ``pytorch_lora_weights.safetensors`` with ``fv_recipe.json``.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import fv_core
from fv_core import ConfigError
from fv_core.adapters import TrainableLora
from fv_core.training import (
    Consistency,
    MethodSpec,
    Role,
    RoleSpec,
    TrainConfig,
    adapter_class,
    load_optimizer,
    make_optimizer,
    save_optimizer,
    set_lr,
    train_adapter,
    validate_options,
)
from fv_train_flow import shapes
from fv_train_flow.config import LORA_TARGETS, FlowOptions

TRAINED = ("transformer", "text_encoder")  # components the student role holds
EVAL_SIGMAS = (0.2, 0.4, 0.6, 0.8, 0.95)  # fixed noise levels of the validation loss
EVAL_GUIDANCE = 4.0  # CFG scale of the sampled evals
LORA = "lora"  # a LoRA run's role entry holding its pairs (beside the shared, frozen base modules)
LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' name, which save_lora writes
RECIPE_FILE = "fv_recipe.json"


class FlowMethod:
    """Flow matching on a Wan checkpoint; see the module docstring."""

    spec = MethodSpec(
        roles=(
            RoleSpec(Role.STUDENT, trains=TRAINED, holds=TRAINED),
            RoleSpec(Role.EMA, holds=TRAINED),
        ),
        consistency=Consistency.C1,
    )

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg, self.opts = cfg, validate_options(FlowOptions, cfg.options, "flow")
        torch.manual_seed(cfg.seed)
        folder = self.base = self.opts.init_weights or self.fresh_checkpoint()
        model = fv_core.load(weights=folder)  # the card from the folder's own configs
        self.adapter = train_adapter(model, max_sequence_length=self.opts.max_sequence_length)
        self.roles: dict[Role, dict[str, torch.nn.Module]] = {}
        if self.opts.lora_rank:
            self.trained: tuple[str, ...] = (LORA,)
            self.lora_roles(folder)
        else:
            self.trained = TRAINED
            student = {name: self.adapter.module(name).requires_grad_(True) for name in TRAINED}
            if not self.opts.train_text_encoder:
                student["text_encoder"].requires_grad_(False)
            self.roles[Role.STUDENT] = student
            self.roles[Role.EMA] = {k: copy.deepcopy(m).requires_grad_(False) for k, m in student.items()}
        self.opt = make_optimizer(self.trainable(), cfg.optim)
        self._pool: tuple[torch.Tensor, list[str]] | None = None

    def lora_roles(self, folder: Path) -> None:
        """Student and EMA pairs over the loaded model's frozen modules, both on its adapter plane."""
        plane = getattr(self.adapter.model.instance, "adapters", None)
        if plane is None:
            raise ConfigError(
                f"options.lora_rank={self.opts.lora_rank}, but the model in {str(folder)!r} "
                f"({self.adapter.model.card.model_id}) takes no adapters. Fix: train a LoRA on a Wan "
                "checkpoint, or drop lora_rank for a full fine-tune"
            )
        base = {name: self.adapter.module(name).requires_grad_(False) for name in TRAINED}
        alpha = self.opts.lora_alpha or self.opts.lora_rank
        targets = self.opts.lora_targets or list(LORA_TARGETS)
        student = TrainableLora(base["transformer"], self.opts.lora_rank, alpha, targets)
        ema = copy.deepcopy(student).requires_grad_(False)
        student.attach(plane, "training-student")
        ema.attach(plane, "training-ema")
        self.roles[Role.STUDENT] = {**base, LORA: student}
        self.roles[Role.EMA] = {**base, LORA: ema}

    def fresh_checkpoint(self) -> Path:
        """``<output_dir>/init``: freshly initialised transformer and text encoder (from ``seed``,
        written once) around the trained ``options.vae`` (copied every time: it may be retrained)."""
        vae = self.opts.vae
        if vae is None or not (Path(vae) / "config.json").is_file():
            raise ConfigError(
                f"options.vae={None if vae is None else str(vae)!r} is not a diffusers vae/ folder (no "
                "config.json). Fix: train one first (fv train configs/shapes/vae.yaml) and point options.vae "
                "at <output_dir>/final/vae, or set options.init_weights to a checkpoint to finetune"
            )
        folder = Path(self.cfg.output_dir) / "init"
        if not (folder / "model_index.json").is_file():
            adapter_class("wan").init_checkpoint(
                folder, self.opts.transformer, self.opts.text_encoder, shapes.vocabulary(), Path(vae)
            )
        shutil.copytree(vae, folder / "vae", dirs_exist_ok=True)
        return folder

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for m in self.roles[Role.STUDENT].values() for p in m.parameters() if p.requires_grad]

    # ---- the step ----

    def step(self, step: int) -> dict[str, float]:
        lr = set_lr(self.opt, self.cfg.optim, step, self.cfg.steps)
        x0, clip_captions = self.clips(step)
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)  # per step: resume is exact
        drop = torch.rand(len(clip_captions), generator=gen) < self.opts.caption_dropout
        captions = ["" if d else c for c, d in zip(clip_captions, drop.tolist(), strict=True)]
        sigma = shifted_sigmas(len(captions), self.opts, gen)
        for module in self.roles[Role.STUDENT].values():
            module.train()
        loss = self.flow_loss(self.roles[Role.STUDENT], x0, captions, sigma, gen, train=True)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(self.trainable(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.update_ema(step)
        return {"loss": loss.item(), "grad_norm": grad.item(), "lr": lr}

    def clips(self, step: int) -> tuple[torch.Tensor, list[str]]:
        """Step ``step``'s normalised latents and captions: the stream's next clips, or a draw from
        the latent pool."""
        size, seed = self.cfg.batch_size, self.cfg.data.seed
        if not self.opts.latent_pool:
            video, specs = shapes.batch(seed, step * size, size, recolour=self.opts.recolour)
            return self.latents(video), [s.caption for s in specs]
        if self._pool is None:
            self._pool = self.latent_pool()
        latents, captions = self._pool
        picks = torch.randint(len(captions), (size,), generator=torch.Generator().manual_seed(seed + step))
        return latents[picks], [captions[i] for i in picks.tolist()]

    def latent_pool(self) -> tuple[torch.Tensor, list[str]]:
        """Latents and captions of the stream's first ``latent_pool`` clips, encoded once and cached."""
        n, seed = self.opts.latent_pool, self.cfg.data.seed
        path = Path(self.cfg.output_dir) / "latent_pool.safetensors"
        weights = sorted(
            (Path(self.adapter.model.weights) / "vae").glob("*.safetensors")
        )  # a retrained VAE invalidates the pool
        vae_hash = hashlib.sha256(b"".join(p.read_bytes() for p in weights)).hexdigest()
        key = {
            "clips": str(n),
            "seed": str(seed),
            "vae_sha256": vae_hash,
            "recolour": json.dumps(self.opts.recolour),
        }
        captions = [s.caption for s in shapes.stream_specs(seed, 0, n)]
        if path.is_file():
            with safe_open(path, "pt") as f:
                if {k: f.metadata().get(k) for k in key} == key:
                    return f.get_tensor("latents"), captions
        start = time.perf_counter()
        recolour = self.opts.recolour
        chunks = [
            self.latents(shapes.batch(seed, i, min(64, n - i), recolour=recolour)[0]) for i in range(0, n, 64)
        ]
        latents = torch.cat(chunks)
        path.parent.mkdir(parents=True, exist_ok=True)
        encode_s = f"{time.perf_counter() - start:.4f}"  # training time that a cached pool hides from wall_s
        save_file({"latents": latents}, path, metadata={**key, "encode_s": encode_s})
        return latents, captions

    def flow_loss(
        self,
        modules: dict[str, torch.nn.Module],
        x0: torch.Tensor,
        captions: list[str],
        sigma: torch.Tensor,
        gen: torch.Generator,
        train: bool = False,
    ) -> torch.Tensor:
        """MSE between the predicted velocity at ``x_sigma`` and ``noise - x0`` (Wan's flow target);
        ``train`` runs the bodies under the train profile (grad), else under the serve profile."""
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        lora = modules.get(LORA)
        with lora.applied() if lora is not None else contextlib.nullcontext():
            embeds = self.adapter.conditioning(captions, modules["text_encoder"], train)
            velocity = self.adapter.velocity(modules["transformer"], noisy, sigma, embeds, train)
        return torch.nn.functional.mse_loss(velocity, noise - x0)

    def latents(self, video: torch.Tensor) -> torch.Tensor:
        """VAE posterior means, normalised (the serve loop's decode inverts this)."""
        return self.adapter.encode_video(video)

    @torch.no_grad()
    def update_ema(self, step: int) -> None:
        decay = 0.0 if step < self.opts.ema_start else self.opts.ema_decay
        for name in self.trained:
            student = self.roles[Role.STUDENT][name]
            for e, s in zip(self.roles[Role.EMA][name].parameters(), student.parameters(), strict=True):
                e.lerp_(s, 1 - decay)

    # ---- evaluation ----

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Validation loss on held-out combinations at fixed sigmas, and (optionally) detector
        accuracy of videos the EMA weights generate through the serve loop."""
        ema = self.roles[Role.EMA]
        for module in ema.values():
            module.eval()
        gen = torch.Generator().manual_seed(12345)
        video, specs = shapes.batch(
            self.cfg.data.seed + 7919, 0, self.opts.eval_clips, tuple(shapes.HELD_OUT), self.opts.recolour
        )
        x0, captions = self.latents(video), [s.caption for s in specs]
        losses = {
            f"val_loss@{s}": self.flow_loss(ema, x0, captions, torch.full((len(specs),), s), gen).item()
            for s in EVAL_SIGMAS
        }
        metrics: dict[str, Any] = {"val_loss": sum(losses.values()) / len(losses), **losses}
        if self.opts.eval_samples:
            report = self.lora_samples() if self.opts.lora_rank else self.folder_samples()
            metrics.update({f"acc_{k}": v for k, v in report["all"].items() if k != "n"})
        return metrics

    def folder_samples(self) -> dict[str, Any]:
        """Detector accuracy of the EMA checkpoint served by ``eval_card``."""
        from fv_train_flow.eval import evaluate_folder

        with tempfile.TemporaryDirectory() as tmp:
            self.export(Path(tmp))
            return evaluate_folder(
                Path(tmp),
                self.opts.eval_samples,
                self.opts.eval_steps,
                EVAL_GUIDANCE,
                card=self.opts.eval_card,
                max_sequence_length=self.opts.max_sequence_length,  # as trained, whatever the card's
            )

    def lora_samples(self) -> dict[str, Any]:
        """Detector accuracy of the loaded model with the EMA pairs, exported and served per request
        (a fresh adapter version each time, so no cache of an earlier evaluation is reused)."""
        from fv_train_flow.eval import evaluate_model

        plane, name = self.adapter.model.instance.adapters, "training-eval"
        with tempfile.TemporaryDirectory() as tmp:
            plane.add(name, self.export(Path(tmp)))
            try:
                return evaluate_model(
                    self.adapter.model,
                    self.opts.eval_samples,
                    self.opts.eval_steps,
                    EVAL_GUIDANCE,
                    max_sequence_length=self.opts.max_sequence_length,
                    adapters=[name],
                )
            finally:
                plane.remove(name)

    # ---- checkpoints ----

    def save(self, folder: Path) -> None:
        """Student and EMA weights (``folder`` is the export: a loadable model, or with ``lora_rank`` the
        EMA LoRA file; ``folder/student`` holds the student) plus optimiser state."""
        self.export(folder)
        for name in self.trained:
            module = self.roles[Role.STUDENT][name]
            if isinstance(module, TrainableLora):
                module.save(folder / "student", self.adapter.model.card.adapters.loader)
            else:
                module.save_pretrained(folder / "student" / name, safe_serialization=True)
        save_optimizer(self.opt, folder / "optimizer.safetensors")

    def load(self, folder: Path) -> None:
        if self.opts.lora_rank:
            self.roles[Role.STUDENT][LORA].load(folder / "student" / LORA_FILE)
            self.roles[Role.EMA][LORA].load(folder / LORA_FILE)
            load_optimizer(self.opt, folder / "optimizer.safetensors")
            return
        for role, root in ((Role.STUDENT, folder / "student"), (Role.EMA, folder)):
            for name, module in self.roles[role].items():
                saved = type(module).from_pretrained(root / name, use_safetensors=True)  # safetensors only
                module.load_state_dict(saved.state_dict())
        load_optimizer(self.opt, folder / "optimizer.safetensors")

    def export(self, folder: Path) -> Path:
        """A complete checkpoint (real diffusers layout) with the EMA weights and the frozen VAE; with
        ``lora_rank``, the EMA pairs as diffusers' LoRA file (returned) and the recipe, whose ``base``
        names the checkpoint they were trained on."""
        recipe: dict[str, Any] = {
            "method": "flow",
            "parents": [str(self.opts.init_weights)] if self.opts.init_weights else [],
        }
        if not self.opts.lora_rank:
            self.adapter.export(folder, self.roles[Role.EMA], recipe)
            return folder
        o = self.opts
        recipe |= {"base": str(self.base), "steps": self.cfg.steps, "seed": self.cfg.seed,
                   "lora": {"rank": o.lora_rank, "alpha": o.lora_alpha or o.lora_rank,
                            "targets": o.lora_targets or list(LORA_TARGETS)}}  # fmt: skip
        file = self.roles[Role.EMA][LORA].save(folder, self.adapter.model.card.adapters.loader)
        (Path(folder) / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        return file


def shifted_sigmas(n: int, opts: FlowOptions, gen: torch.Generator) -> torch.Tensor:
    """Noise levels in (0, 1): uniform or logit-normal, then Wan's flow shift (more weight on high noise)."""
    u = (
        torch.rand(n, generator=gen)
        if opts.timestep_sampling == "uniform"
        else torch.randn(n, generator=gen).sigmoid()
    )
    u = u.clamp(1e-3, 1 - 1e-3)
    return opts.shift * u / (1 + (opts.shift - 1) * u)
