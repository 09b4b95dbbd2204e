"""The BAGEL network around the MoT decoder: the generation heads (``vae2llm`` / ``llm2vae``, the
timestep embedder, the 2-D latent position table) and the understanding tower (SigLIP NaViT,
its connector and position table). Parameter names equal the published ``ema.safetensors`` keys.

The SigLIP tower is transformers' ``SiglipEncoder`` under an embedding that takes flattened
``14 x 14 x 3`` patches through a linear layer (BAGEL stores the patch convolution as a linear
layer) plus a learned table looked up by flattened patch position (``row * side + col``), so any
image size up to ``side`` patches a side runs at its own aspect ratio (NaViT).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen2Config, SiglipVisionConfig
from transformers.models.siglip.modeling_siglip import SiglipEncoder

from fv_bagel.mot import MLPConnector, MoTLanguageModel, PositionEmbedding, TimestepEmbedder, linear


class SiglipNavitEmbeddings(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        patch, size = int(config.patch_size), int(config.image_size)  # type: ignore[arg-type]
        self.patch_embedding = nn.Linear(config.num_channels * patch**2, config.hidden_size)
        side = size // patch
        self.position_embedding = nn.Embedding(side * side, config.hidden_size)


class SiglipNavitTransformer(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipNavitEmbeddings(config)
        self.encoder = SiglipEncoder(config)  # type: ignore[arg-type]  # it takes the vision config
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class SiglipNavit(nn.Module):
    """SigLIP over one image's patches ``[N, p*p*3]`` at flattened positions ``[N]``."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = SiglipNavitTransformer(config)

    def forward(self, patches: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        vm = self.vision_model
        x = vm.embeddings.patch_embedding(patches) + vm.embeddings.position_embedding(ids)
        x = vm.encoder(inputs_embeds=x[None]).last_hidden_state[0]
        return vm.post_layernorm(x)


class BagelNet(nn.Module):
    """Everything in ``ema.safetensors``: the MoT language model and both image paths."""

    def __init__(
        self,
        llm_config: Qwen2Config,
        vit_config: SiglipVisionConfig,
        *,
        latent_channels: int,
        max_latent_size: int,
        vit_side: int,
        latent_patch_size: int = 2,
        connector_act: str = "gelu_pytorch_tanh",
    ) -> None:
        super().__init__()
        hidden = llm_config.hidden_size
        self.latent_patch_size = latent_patch_size
        self.latent_channels = latent_channels
        self.language_model = MoTLanguageModel(llm_config)
        self.time_embedder = TimestepEmbedder(hidden)
        self.vae2llm = nn.Linear(latent_patch_size**2 * latent_channels, hidden)
        self.llm2vae = nn.Linear(hidden, latent_patch_size**2 * latent_channels)
        self.latent_pos_embed = PositionEmbedding(max_latent_size, hidden)
        self.vit_model = SiglipNavit(vit_config)
        self.connector = MLPConnector(vit_config.hidden_size, hidden, connector_act)
        self.vit_pos_embed = PositionEmbedding(vit_side, hidden)

    @property
    def max_latent_size(self) -> int:
        return self.latent_pos_embed.side

    @property
    def vit_side(self) -> int:
        return self.vit_pos_embed.side

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(ids)

    def vit_embeds(self, patches: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One image's ViT tokens in the decoder's width: tower, connector, plus the position table."""
        return self.connector(self.vit_model(patches, ids)) + self.vit_pos_embed(ids)

    def latent_embeds(self, x: torch.Tensor, t: torch.Tensor, ids: torch.Tensor, exact: bool) -> torch.Tensor:
        """Patchified latents ``[B, N, p*p*C]`` at flow time ``t`` ``[B]`` and grid ids ``[N]``: decoder inputs."""
        b, n, _ = x.shape
        temb = self.time_embedder(t, exact)[:, None, :]
        return linear(x, self.vae2llm, exact) + temb + self.latent_pos_embed(ids)[None]
