"""The ``vae`` method: train a (tiny) diffusers ``AutoencoderKLWan`` on shapes clips.

The VAE has no serve step to share beyond encode/decode, so the module itself is trained:
reconstruction MSE of the posterior mean (object pixels weighted up, the background dominates
otherwise) plus a small KL. Decoding the mean rather than a sample keeps the start from collapsing
to a background-only output while the encoder's signal is still below the posterior noise.
The export sets ``latents_mean`` / ``latents_std`` to the per-channel statistics of the training
latents, so the normalised latents the transformer sees have unit scale, exactly as Wan's
pipeline and ``fv_wan.bodies.decode_body`` use them.

With a frozen encoder, clips longer than 9 frames (``clip_frames``) teach the decoder long videos in
the same latent space: their latents are ``stationary_latents`` (every latent frame one that the
encoder makes of a 9-frame clip, as a causal student rolls them out), so the transformers trained on
it stay valid.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fv_core.training import (
    Consistency,
    MethodSpec,
    Role,
    RoleSpec,
    TrainConfig,
    load_optimizer,
    make_optimizer,
    save_optimizer,
    set_lr,
    validate_options,
)
from fv_train_flow import shapes
from fv_train_flow.config import VaeOptions
from fv_train_flow.detect import detect


class VaeMethod:
    """Reconstruction training of ``AutoencoderKLWan``; the exported folder is a diffusers ``vae/``."""

    spec = MethodSpec(
        roles=(RoleSpec(Role.STUDENT, trains=("vae",), holds=("vae",)),), consistency=Consistency.C1
    )

    def __init__(self, cfg: TrainConfig) -> None:
        from diffusers import AutoencoderKLWan

        self.cfg, self.opts = cfg, validate_options(VaeOptions, cfg.options, "vae")
        torch.manual_seed(cfg.seed)
        if self.opts.init is None:
            self.vae = AutoencoderKLWan(**self.opts.vae)
        else:
            self.vae = AutoencoderKLWan.from_pretrained(self.opts.init, use_safetensors=True)
        if not self.opts.train_encoder:  # the latent space stays fixed: only the decoder learns
            self.vae.encoder.requires_grad_(False)
            self.vae.quant_conv.requires_grad_(False)
        self.roles = {Role.STUDENT: {"vae": self.vae}}
        self.params = [p for p in self.vae.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg.optim)

    def step(self, step: int) -> dict[str, float]:
        lr = set_lr(self.opt, self.cfg.optim, step, self.cfg.steps)
        frames = self.opts.clip_frames[step % len(self.opts.clip_frames)]
        video = _clips(self.cfg.data.seed, step * self.cfg.batch_size, self.cfg.batch_size, frames)
        self.vae.train()
        with torch.autocast("cpu", torch.bfloat16, enabled=self.opts.bf16):
            if self.opts.train_encoder:
                posterior = self.vae.encode(video).latent_dist
                z, kl = posterior.mode(), posterior.kl().mean() / video[0].numel()
            else:  # the encoder is fixed, so is its KL: only reconstruction trains the decoder
                with torch.no_grad():
                    z, kl = stationary_latents(self.vae, video), torch.zeros(())
            recon = self.vae.decode(z).sample.float()
        weight = 1 + self.opts.foreground_weight * _foreground(video)
        mse = (weight * (recon - video) ** 2).mean() / weight.mean()
        loss = mse + self.opts.kl_weight * kl
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        self.opt.step()
        return {
            "loss": loss.item(),
            "loss_mse": mse.item(),
            "kl": kl.item(),
            "grad_norm": grad.item(),
            "lr": lr,
        }

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Reconstruction error and detector accuracy on reconstructions of clips of every combination;
        with long clips also on their last 9 frames (direction: the detector's read of the real clip)."""
        self.vae.eval()
        video, specs = shapes.batch(self.cfg.data.seed + 7919, 0, self.opts.eval_clips, shapes.ALL_COMBOS)
        recon = self.vae.decode(self.vae.encode(video).latent_dist.mode()).sample.clamp(-1, 1)
        frames = (recon.permute(0, 2, 3, 4, 1) + 1) / 2
        hits = [detect(f).matches(s) for f, s in zip(frames, specs, strict=True)]
        out = {k: sum(h[k] for h in hits) / len(hits) for k in ("colour", "shape", "direction")}
        out["mse"] = ((recon - video) ** 2).mean().item()
        longest = max(self.opts.clip_frames)
        if longest > shapes.FRAMES:
            video, specs = shapes.long_batch(
                self.cfg.data.seed + 7919, 0, self.opts.eval_clips, longest, shapes.ALL_COMBOS
            )
            recon = self.vae.decode(stationary_latents(self.vae, video)).sample.clamp(-1, 1)
            tails = ((torch.stack([recon, video]) + 1) / 2)[:, :, :, -shapes.FRAMES :].permute(
                0, 1, 3, 4, 5, 2
            )
            reads = [(detect(r), detect(t), s) for r, t, s in zip(tails[0], tails[1], specs, strict=True)]
            for axis in ("colour", "shape", "direction"):
                hit = [
                    getattr(r, axis) == getattr(t if axis == "direction" else s, axis) for r, t, s in reads
                ]
                out[f"last9_of_{longest}_{axis}"] = sum(hit) / len(hit)
            out[f"mse_{longest}"] = ((recon - video) ** 2).mean().item()
        return out

    def save(self, folder: Path) -> None:
        self.vae.save_pretrained(folder / "vae", safe_serialization=True)
        save_optimizer(self.opt, folder / "optimizer.safetensors")

    def load(self, folder: Path) -> None:
        from diffusers import AutoencoderKLWan

        self.vae.load_state_dict(
            AutoencoderKLWan.from_pretrained(folder / "vae", use_safetensors=True).state_dict()
        )
        load_optimizer(self.opt, folder / "optimizer.safetensors")

    @torch.no_grad()
    def export(self, folder: Path) -> None:
        """``folder/vae`` with latents_mean/std measured on training clips (unchanged when the encoder
        was frozen: same encoder, same clips)."""
        self.vae.eval()
        latents = []
        for i in range(0, self.opts.stats_clips, 32):
            video, _ = shapes.batch(self.cfg.data.seed + 104729, i, 32)
            latents.append(self.vae.encode(video).latent_dist.mode())
        z = torch.cat(latents).transpose(0, 1).flatten(1)  # [C, N]
        self.vae.register_to_config(latents_mean=z.mean(1).tolist(), latents_std=z.std(1).tolist())
        self.vae.save_pretrained(folder / "vae", safe_serialization=True)


def stationary_latents(vae: torch.nn.Module, video: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, T, h, w] of clips [B, 3, F, H, W] (F = 4(T-1)+1) where latent frame j >= 3 is the
    third latent frame of the 9-frame clip ending at its last frame (frames 4j-8 .. 4j), the first three
    those of frames 0..8: each latent frame is one the encoder makes of a 9-frame clip."""
    z = vae.encode(video[:, :, : shapes.FRAMES]).latent_dist.mode()
    latent_frames = (video.shape[2] - 1) // 4 + 1
    if latent_frames > 3:
        windows = torch.cat([video[:, :, 4 * j - 8 : 4 * j + 1] for j in range(3, latent_frames)])
        tail = vae.encode(windows).latent_dist.mode()[:, :, 2]  # [(T-3)*B, C, h, w]
        tail = tail.unflatten(0, (latent_frames - 3, video.shape[0])).permute(1, 2, 0, 3, 4)
        z = torch.cat([z, tail], 2)
    return z


def _clips(seed: int, index: int, size: int, frames: int) -> torch.Tensor:
    """Training clips [B, 3, F, H, W]: the 9-frame stream, or long clips that turn (``render_long``)."""
    if frames == shapes.FRAMES:
        return shapes.batch(seed, index, size)[0]
    return shapes.long_batch(seed, index, size, frames)[0]


def _foreground(video: torch.Tensor) -> torch.Tensor:
    """1 on object pixels of video [B, 3, F, H, W] in -1..1, else 0."""
    background = torch.tensor(shapes.BACKGROUND).view(1, 3, 1, 1, 1) * 2 - 1
    return ((video - background).abs().amax(1, keepdim=True) > 0.1).float()
