"""A live BAGEL instance: one resident network serves every loop (AR decode and denoise) of every
request. Components load on first use: ``net`` (``ema.safetensors``) and ``tokenizer`` for any
request, the FLUX ``vae`` only when an image is decoded (a text-only request never loads it).

Weight sync (``fv_core.training.sync_weights``) comes from the core's ``SyncableComponents``: ``net``
(everything in ``ema.safetensors``: the MoT decoder, the SigLIP tower, its connector, the generation
heads) and ``vae`` (``ae.safetensors``) are the syncable components, each versioned by its file's
fingerprint until a sync names a new version. Requests pin both versions at init and run every step on
those modules; keys/values in the KV pool are read only under the ``net`` version that made them (the
prefix cache's namespaces carry it), so a swap drops nothing and a replaced version is freed when the
last request pinning it ends (its cached prefixes are evicted as the pool needs their pages).

Prefix caching (``prefix_caching``, on by default): contexts' pages stay in the pool after their request,
in a :class:`fv_core.kv.PrefixCache`, for later requests that start with the same tokens.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import torch

from fv_bagel.checkpoint import check_layout, llm_config, load_net, load_tokenizer, vit_config
from fv_bagel.sharing import Prefilling
from fv_core import ConfigError
from fv_core.card import ModelCard
from fv_core.kv import PagedKVPool, PrefixCache
from fv_core.weights import SyncableComponents, file_fingerprint

_IDS = itertools.count()
KV_PAGE = 16  # tokens per KV page
DEFAULT_KV_BYTES = 64 << 20
COMPONENTS = ("net", "tokenizer", "vae")


class BagelModel(SyncableComponents):
    """Resident components of one card on one checkpoint (the ``instance`` BAGEL loops run against).

    :param exact: run the row-invariant math of :mod:`fv_bagel.mot` (batched == alone, bit for bit).
    :param prefix_caching: share the pages of contexts' common prefixes across requests.
    """

    def __init__(
        self,
        card: ModelCard,
        weights: str | Path,
        device: str | torch.device = "cpu",
        kernels: dict[str, Any] | None = None,
        exact: bool = False,
        prefix_caching: bool = True,
    ) -> None:
        self.card = card
        self.prefix_caching = prefix_caching
        self.weights = check_layout(weights)
        (
            llm_config(self.weights),
            vit_config(self.weights),
        )  # configs are checked at load, weights on first use
        self.device = torch.device(device)
        self.dtype = getattr(torch, card.precision.default)
        self.exact = exact
        self.kernels = dict(kernels or {})  # attention sdpa only: the card's accepts_kernels
        self.instance_id = f"{card.model_id}#{next(_IDS)}"  # batch keys: plans on these weights
        self.weights_versions = {"net": file_fingerprint(self.weights / "ema.safetensors")}
        if (self.weights / "ae.safetensors").is_file():
            self.weights_versions["vae"] = file_fingerprint(self.weights / "ae.safetensors")
        self.parallel: Any = None  # BAGEL runs in one process (no parallel plan); weight syncs need that
        self._components: dict[str, Any] = {}
        self._kv_pool: PagedKVPool | None = None
        self._prefix: PrefixCache | None = None
        self.prefilling = Prefilling()  # contexts being prefilled: requests arriving with them wait
        self._lock = threading.Lock()
        self._init_sync()

    def component(self, name: str, version: str | None = None) -> Any:
        """The live component ``name`` (``net``, ``tokenizer`` or ``vae``), loaded on first use; with
        ``version``, that version of its weights (a request pinned to one a weight sync replaced)."""
        if name not in COMPONENTS:
            raise ConfigError(f"BAGEL has no component {name!r}. Fix: use one of {list(COMPONENTS)}")
        return super().component(name, version)

    def _load(self, name: str) -> Any:
        """Component ``name`` from the folder, on the device: normal tensors even when first used under
        ``torch.inference_mode`` (serving), so a weight sync can copy into them and training can use them."""
        with torch.inference_mode(False):
            if name == "net":
                return load_net(self.weights, self.dtype, self.device)
            if name == "tokenizer":
                return load_tokenizer(self.weights)
            from fv_bagel.vae import load_flux_vae

            check_layout(self.weights, vae=True)
            return load_flux_vae(self.weights / "ae.safetensors", self.dtype, self.device)

    @property
    def net(self) -> Any:
        """The live ``net`` (loops use the version their request pinned: ``component("net", version)``)."""
        return self.component("net")

    @property
    def tokenizer(self) -> Any:
        return self.component("tokenizer")[0]

    @property
    def special(self) -> dict[str, int]:
        """BAGEL's special token ids: ``bos_token_id``, ``eos_token_id``, ``start_of_image``, ``end_of_image``."""
        return self.component("tokenizer")[1]

    @property
    def kv_pool(self) -> PagedKVPool:
        """The paged pool of AR contexts' keys/values (the card's ``kv`` cache budget), made on first use."""
        with self._lock:
            if self._kv_pool is None:
                layers, kvh, d = self.component_unlocked("net").language_model.kv_shape
                budget = self.card.caches["kv"].max_bytes or DEFAULT_KV_BYTES
                self._kv_pool = PagedKVPool(
                    layers, kvh, d, page_size=KV_PAGE, max_bytes=budget, dtype=self.dtype, device=self.device
                )
            return self._kv_pool

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix cache over the KV pool (None while ``prefix_caching`` is off), made on first use."""
        pool = self.kv_pool
        if not self.prefix_caching:
            return None
        with self._lock:
            if self._prefix is None:
                self._prefix = PrefixCache(pool)
            return self._prefix

    def component_unlocked(self, name: str) -> Any:
        if name not in self._components:
            self._components[name] = self._load(name)
        return self._components[name]

    def loaded(self) -> list[str]:
        """Components resident now."""
        return sorted(self._components)

    @property
    def precision(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def resident_bytes(self) -> int:
        """Bytes admission reserves: the resident components' parameters and buffers (retired versions a
        running request still pins included), plus the KV pool at its budget (allocated whole on first
        use; its pages are admitted per request, see the loops' ``kv_need``)."""
        return self.weights_bytes() + (self.card.caches["kv"].max_bytes or DEFAULT_KV_BYTES)


def exact_model(
    card: ModelCard, weights: str | Path, device: str | torch.device = "cpu", kernels: Any = None
) -> BagelModel:
    """The tiny card's instance: row-invariant math, so batched and ragged steps equal solo runs bit for bit."""
    return BagelModel(card, weights, device, kernels, exact=True)
