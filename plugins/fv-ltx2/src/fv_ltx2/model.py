"""A live LTX-2 instance: a card bound to a checkpoint folder.

Components load lazily (diffusers' and transformers' own classes, safetensors only) and are shared
by every request; the instance also holds the text feature cache (Gemma + connectors outputs per
prompt), each component's weights version and the scheduler config. On a parallel group
(``fv_core.load(..., parallel=)``) its denoise calls run on the group's ranks (:mod:`fv_ltx2.parallel`).

Weight sync (``fv_core.training.sync_weights``) comes from the core's ``SyncableComponents``: requests
pin every component's version at init and look components up by version. The text features go with
a new text encoder or connectors, the LoRA-merged refine weights with the transformer version they
were merged into.
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
from fv_core.cache import FeatureCache
from fv_core.card import ModelCard
from fv_core.weights import (
    SyncableComponents,
    file_fingerprint,
    load_component,
    refuse_pickles,
    weights_fingerprint,
)
from fv_ltx2.transformer import unsupported

_IDS = itertools.count()
WEIGHTED = ("text_encoder", "connectors", "transformer", "vae", "audio_vae", "vocoder")


class LTX2Model(SyncableComponents):
    """Resident components of one LTX-2 card on one checkpoint (the ``instance`` its loop runs on)."""

    def __init__(
        self,
        card: ModelCard,
        weights: str | Path,
        device: str | torch.device = "cpu",
        kernels: dict[str, tuple[Any, dict[str, Any]]] | None = None,
    ):
        self.card = card
        self.weights = Path(weights)
        refuse_pickles(self.weights)
        self.device = torch.device(device)
        self.dtype = getattr(torch, card.precision.default)
        self.scheduler_config = json.loads((self.weights / "scheduler" / "scheduler_config.json").read_text())
        self.feature_cache = FeatureCache(
            card.caches["text_embeddings"].capacity
        )  # prompt -> connector outputs
        kv = card.caches["text_kv"]  # prompt -> every block's text keys/values (fv_ltx2.prompt_kv)
        self.kv_cache = FeatureCache(kv.capacity, kv.max_bytes)
        self.weights_versions = {name: weights_fingerprint(self.weights, name) for name in WEIGHTED}
        lora = card.components.get("refine_lora")
        if lora is not None and lora.subfolder and (self.weights / lora.subfolder).is_file():
            self.weights_versions["refine_lora"] = file_fingerprint(self.weights / lora.subfolder)
        self.instance_id = f"{card.model_id}#{next(_IDS)}"  # batch keys: plans on these weights
        self.parallel: Any = None  # the ParallelGroup its denoise calls run on (fv_core.load sets it)
        self._components: dict[str, Any] = {}
        # transformer version -> its weights with the refine LoRA merged in
        self._refine: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._init_sync()

    def _load(self, name: str) -> Any:
        """Component ``name`` from the folder, on the device (normal tensors even under inference mode, so
        training and train-profile replays can use the same instance)."""
        with torch.inference_mode(False):
            module = load_component(self.weights, name, self.card.components[name], self.dtype)
            return module.to(self.device) if isinstance(module, torch.nn.Module) else module

    def _syncable(self) -> list[str]:
        return sorted(WEIGHTED)  # the refine LoRA is a file the refine stage merges, not a module

    def _feature_caches(self) -> tuple[FeatureCache, ...]:
        # keyed by the connectors' (keys/values: the transformer's) version, with the others' as extra
        return (self.feature_cache, self.kv_cache)

    def _replace_features(self, component: str, old: str) -> int:
        """A new text encoder makes every cached text feature stale (they all came from an older one)."""
        if component in ("text_encoder", "connectors"):  # keys/values were made from their features
            stale = self.kv_cache.invalidate()
            if component == "text_encoder":
                return stale + self.feature_cache.invalidate()
            return stale + super()._replace_features(component, old)
        return super()._replace_features(component, old)

    def _drop_features(self, component: str, version: str) -> int:
        """The refine weights merged into a transformer version go with it, unless a running request
        still pins it."""
        if component == "transformer" and (component, version) not in self._retired:
            with self._lock:
                self._refine.pop(version, None)
        return super()._drop_features(component, version)

    def refine_weights(self, version: str | None = None) -> dict[str, torch.Tensor]:
        """The transformer weights (``version``'s, default the live ones) with the card's refine LoRA
        merged in (``W + alpha/r * B @ A`` per adapted projection), computed once per version; empty when
        the folder ships no refine LoRA."""
        version = version or self.weights_versions["transformer"]
        transformer = self.component("transformer", version)
        with self._lock:
            if version in self._refine:
                return self._refine[version]
            merged = self._merge_lora(transformer)
            # kept only while its version is resident: a swap between the lookup above and here may have
            # dropped it, and nothing would drop this merge again
            if version == self.weights_versions["transformer"] or ("transformer", version) in self._retired:
                self._refine[version] = merged
            return merged

    def _merge_lora(self, transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        from diffusers.loaders.lora_pipeline import LTX2LoraLoaderMixin

        spec = self.card.components.get("refine_lora")
        file = self.weights / spec.subfolder if spec is not None and spec.subfolder else None
        if file is None or not file.is_file():
            return {}
        state = LTX2LoraLoaderMixin.lora_state_dict(str(file), use_safetensors=True)
        if any(not k.startswith("transformer.") for k in state):
            raise ConfigError(
                f"{file.name} adapts more than the transformer ({sorted({k.split('.')[0] for k in state})}); fv "
                "merges transformer LoRAs only. Fix: use a LoRA of the transformer."
            )
        weights = dict(transformer.named_parameters())
        merged = {}
        for key, down in state.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            up = state[f"transformer.{module}.lora_B.weight"]
            alpha = state.get(f"transformer.{module}.alpha")
            scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
            base = weights[f"{module}.weight"]
            merged[f"{module}.weight"] = base + scale * (up.to(base) @ down.to(base))
        return merged

    def parallel_shape(self) -> dict[str, int]:
        """What a parallel plan is checked against: the attention heads Ulysses shards (a sequence degree
        must divide both the video and the audio heads: their greatest common divisor is given) and the
        guidance branches of a call (the ``cfg`` call's two rows)."""
        config = json.loads((self.weights / "transformer" / "config.json").read_text())
        why = unsupported(config)
        if why is not None:
            raise ConfigError(
                f"card {self.card.model_id!r} cannot run on a parallel group: {why}, and fv drives only "
                "LTX-2.0 transformers block by block. Fix: drop the parallel plan."
            )
        video, audio = (int(config.get(k, 32)) for k in ("num_attention_heads", "audio_num_attention_heads"))
        return {"heads": math.gcd(video, audio), "branches": 2}

    @property
    def num_blocks(self) -> int:
        """Transformer blocks, read from the folder's config (the transformer need not be loaded)."""
        return int(json.loads((self.weights / "transformer" / "config.json").read_text())["num_layers"])

    def loaded(self) -> list[str]:
        """Names of the resident components."""
        return sorted(self._components)

    def resident_bytes(self) -> int:
        """Bytes of the resident components' parameters and buffers (retired versions included), and of
        the LoRA-merged refine weights once made, and the prompt keys/values cache's budget (read by
        admission)."""
        merged = [t for weights in self._refine.values() for t in weights.values()]
        kv = self.kv_cache.nbytes if self.kv_cache.max_bytes is None else self.kv_cache.max_bytes
        return self.weights_bytes() + sum(t.numel() * t.element_size() for t in merged) + kv
