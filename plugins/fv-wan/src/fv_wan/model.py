"""A live Wan model instance: a card bound to a checkpoint folder.

Components load lazily, when a request's work first needs them, and are
shared by every request on the instance: Wan2.2 A14B's low-noise expert is
loaded by the first step that runs on it, CLIP by the first I2V request. The
instance also owns the text-embedding and text K/V FeatureCaches (bounded by
the card's byte budgets, which its resident bytes count for admission) and
each component's weights version, which scopes them, and the kernels it runs: an
attention kernel resolved by the core (``kernels``) runs every block's
self-attention and is reported, with the path each result took, in its metrics.

Weight sync (``fv_core.training.sync_weights``) comes from the core's ``SyncableComponents``:
requests pin every component's version at init and look components up by version, so a replaced
module stays resident while a running request uses it.

``CausalWanModel`` adds causal Wan's paged KV pool (its chunks' keys/values) and open sessions.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from pathlib import Path
from typing import Any

import torch

from fv_core import ConfigError
from fv_core.cache import FeatureCache, RepeatedTail
from fv_core.card import CacheContract, ModelCard
from fv_core.kv import PagedKVPool
from fv_core.weights import SyncableComponents, weights_fingerprint
from fv_wan.attention import describe, grid_of, install
from fv_wan.checkpoint import check_layout, load_component, load_scheduler_config
from fv_wan.sessions import DEFAULT_TTL_S, Sessions
from fv_wan.variant import WanVariant

_IDS = itertools.count()
DEFAULT_KV_BYTES = 64 << 20  # a causal card's KV pool budget when its causal_kv cache names none


class WanModel(SyncableComponents):
    """Resident components of one card on one checkpoint (the ``instance`` Wan loops run against)."""

    def __init__(
        self,
        card: ModelCard,
        weights: str | Path,
        device: str | torch.device = "cpu",
        kernels: dict[str, tuple[Any, dict[str, Any]]] | None = None,
    ):
        self.card = card
        if kernels is None and card.kernels.get("attention", "sdpa") != "sdpa":
            raise ConfigError(
                f"card {card.model_id!r} selects attention {card.kernels['attention']!r}, but no kernels were "
                "resolved. Fix: load it with fv_core.load(...), which resolves the card's kernels."
            )
        self.kernels = kernels  # op -> (impl, selection record) as load selected them; None: diffusers' SDPA
        self.weights = check_layout(weights)
        self.variant = WanVariant.of(self.weights)
        self.device = torch.device(device)
        self.dtype = getattr(torch, card.precision.default)
        self.scheduler_config = load_scheduler_config(self.weights)
        caches = card.caches
        self.feature_cache = _cache(caches["text_embeddings"])  # prompt -> UMT5 embeddings
        # prompt -> per-block text keys/values, put folded (RepeatedTail: without their padding repeats)
        self.kv_cache = _cache(caches["text_kv"], unpack=RepeatedTail.expand)
        self.weights_versions = {
            name: weights_fingerprint(self.weights, spec.subfolder or name)
            for name, spec in card.components.items()
            if spec.kind in ("dit", "vae", "text_encoder", "image_encoder")
        }
        self.parallel: Any = None  # the ParallelGroup its denoise steps run on (fv_core.load sets it)
        self._components: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._init_sync()
        self.instance_id = f"{card.model_id}#{next(_IDS)}"  # batch keys: plans on these weights

    def components_for(self, task: str) -> list[str]:
        """Components the card requires for ``task``."""
        if task not in self.card.programs:
            raise ConfigError(
                f"card {self.card.model_id!r} does not serve task {task!r}. Fix: use one of {self.card.tasks}"
            )
        return sorted(n for n, spec in self.card.components.items() if task in spec.required_for)

    def _load(self, name: str) -> Any:
        """Component ``name`` from the checkpoint folder, on the device, running the card's kernels. Its
        tensors are normal ones even when first used under ``torch.inference_mode`` (serving), so
        training and train-profile replays can use the same instance."""
        spec = self.card.components[name]
        with torch.inference_mode(False):
            module = load_component(self.weights, spec.subfolder or name, self.dtype)
            if isinstance(module, torch.nn.Module):
                module = module.to(self.device)
        if name in self.variant.experts and self.kernels is not None:
            install(module, self.kernels["attention"][0], self.card.model_id)
        if name == "vae":
            from fv_wan.vae_norm import install_batch_norms  # imports diffusers: only once a VAE loads

            install_batch_norms(module)
        return module

    def kernel_records(self, latents: torch.Tensor | None = None) -> dict[str, Any]:
        """The kernels that ran, for a result's provenance; with ``latents``, the attention call made at
        their token grid (implementation path, geometry, any fallback reason)."""
        if self.kernels is None:
            return {"attention": "sdpa"}  # diffusers' own processor: torch SDPA
        impl, record = self.kernels["attention"]
        grid = None
        if latents is not None:
            grid = grid_of(latents, self.component("transformer").config.patch_size)
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        packed = {op: rec for op, (_, rec) in self.kernels.items() if op == "packed_attention"}
        return {"attention": describe(impl, record, self.card.model_id, grid, probe), **packed}

    def resident_bytes(self) -> int:
        """Bytes admission reserves for this instance: the resident components' parameters and buffers,
        plus each cache at its byte budget (it may fill to it while admitted requests run)."""
        return self.weights_bytes() + sum(_reserve(c) for c in (self.feature_cache, self.kv_cache))

    def cache_bytes(self) -> dict[str, int]:
        """Bytes each cache holds now."""
        return {"text_embeddings": self.feature_cache.nbytes, "text_kv": self.kv_cache.nbytes}

    def parallel_shape(self) -> dict[str, int]:
        """What a parallel plan is checked against: attention heads (Ulysses shards them) and the
        guidance branches of a step."""
        config = json.loads((self.weights / "transformer" / "config.json").read_text())
        if self.kernels is None:
            raise ConfigError(
                "parallel Wan runs self-attention through fv's kernels. Fix: load it with fv_core.load(...)."
            )
        return {"heads": int(config["num_attention_heads"]), "branches": 2}

    @property
    def num_blocks(self) -> int:
        """Transformer blocks, read from the folder's config (the transformer need not be loaded)."""
        return int(json.loads((self.weights / "transformer" / "config.json").read_text())["num_layers"])

    def loaded(self) -> list[str]:
        """Names of the resident components."""
        return sorted(self._components)

    def release(self, keep: set[str]) -> None:
        """Drop every resident component not in ``keep`` (but synced ones: their weights exist nowhere else)."""
        with self._lock:
            for name in [n for n in self._components if n not in keep and n not in self._synced]:
                del self._components[name]

    def _feature_caches(self) -> tuple[FeatureCache, ...]:
        return (self.feature_cache, self.kv_cache)

    def _replace_features(self, component: str, old: str) -> int:
        """Text keys/values come from the transformer applied to text embeddings, so they go with either."""
        if component == "text_encoder":
            embeddings = self.feature_cache.invalidate(component=component, weights_version=old)
            return embeddings + self.kv_cache.invalidate()
        return super()._replace_features(component, old)


def _cache(contract: CacheContract, **codec: Any) -> FeatureCache:
    return FeatureCache(contract.capacity, contract.max_bytes, **codec)


def _reserve(cache: FeatureCache) -> int:
    """A cache's share of resident bytes: its budget, or what it holds when it has none."""
    return cache.nbytes if cache.max_bytes is None else cache.max_bytes


class CausalWanModel(WanModel):
    """A Wan instance whose causal loops keep their chunks' keys/values in a paged KV pool (the card's
    ``causal_kv`` byte budget, allocated whole on first use and counted in the resident bytes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        v = self.variant
        if v.conditioning != "none" or len(v.experts) > 1 or v.patch[0] != 1:
            raise ConfigError(
                f"card {self.card.model_id!r} runs causal Wan on {str(self.weights)!r}, a folder with "
                f"{v.conditioning!r} image conditioning, experts {list(v.experts)} and patch {v.patch}; causal "
                "Wan runs a text-to-video transformer with one expert and one latent frame per patch (Wan2.1 "
                "T2V). Fix: load a Wan2.1 T2V folder."
            )
        self._pool: PagedKVPool | None = None
        self._pool_lock = threading.Lock()
        self._sessions: Sessions | None = None

    @property
    def sessions(self) -> Sessions:
        """The open sessions (videos continued across requests) over the KV pool."""
        pool = self.kv_pool
        with self._pool_lock:
            if self._sessions is None:
                self._sessions = Sessions(pool)
            return self._sessions

    def open_session(self, ttl_s: float = DEFAULT_TTL_S) -> str:
        """A new session's id: requests with ``session_id`` continue one video, chunk after chunk."""
        return self.sessions.open(ttl_s)

    @property
    def rope_frames(self) -> int:
        """Latent frames Wan's rope table places (a session's video can grow up to it)."""
        return int(self.component("transformer").rope.max_seq_len)

    def close_session(self, session_id: str) -> bool:
        """Close a session and return its pages (False: it was not open)."""
        return self.sessions.close(session_id)

    @property
    def kv_budget(self) -> int:
        cache = self.card.caches.get("causal_kv")
        return (cache.max_bytes if cache is not None else None) or DEFAULT_KV_BYTES

    @property
    def kv_pool(self) -> PagedKVPool:
        """The pool of every causal request's cached keys/values (pages of ``page_size`` tokens)."""
        with self._pool_lock:
            if self._pool is None:
                config = json.loads((self.weights / "transformer" / "config.json").read_text())
                self._pool = PagedKVPool(
                    int(config["num_layers"]),
                    int(config["num_attention_heads"]),
                    int(config["attention_head_dim"]),
                    page_size=self.page_size,
                    max_bytes=self.kv_budget,
                    dtype=self.dtype,
                    device=self.device,
                )
            return self._pool

    @property
    def page_size(self) -> int:
        """Tokens per page: a divisor of the tokens of one latent frame at the card's default size (at most
        256), so dropping whole frames from a window returns whole pages."""
        defaults = next(iter(self.card.programs.values())).defaults
        step = self.variant.spatial_scale * 2  # VAE x scale, patch x 2
        tokens = (int(defaults.get("height", 480)) // step) * (int(defaults.get("width", 832)) // step)
        return math.gcd(max(tokens, 1), 256)

    def resident_bytes(self) -> int:
        return super().resident_bytes() + self.kv_budget
