"""Hugging Face repo ids as weights: ``owner/name`` (or ``owner/name@revision``) read as a local folder.

``huggingface_hub.snapshot_download`` finds the snapshot in its cache first (offline, or with
``HF_HUB_OFFLINE=1``, the cache is the only source); online it downloads what is missing, with its
progress bar. Only the files a card reads are fetched (its components' folders, ``model_index.json``),
and of those only safetensors weights, JSON configs and tokenizer files: never a pickle.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from fv_core.card.spec import ModelCard
from fv_core.errors import WeightsError
from fv_core.weights import refuse_pickles

# what may be fetched: weights as safetensors, configs, tokenizer vocabularies (no pickle suffix matches)
SAFE = ("*.safetensors", "*.json", "*.txt", "*.model")
REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
ONLINE_FIX = "run once with a connection (unset HF_HUB_OFFLINE) to download it, or pass a local folder"


@dataclass(frozen=True)
class Snapshot:
    """A repo's snapshot in the local cache: the folder the weights are read from and where it came from."""

    folder: Path
    repo: str
    revision: str  # as asked: a branch, tag or commit
    commit: str  # the commit the revision resolved to (the snapshot folder's name)

    def record(self) -> dict[str, str]:
        """What a provenance records: repo, revision, commit and the local snapshot folder."""
        return {"repo": self.repo, "revision": self.revision, "commit": self.commit, "path": str(self.folder)}


def is_repo_id(value: Any) -> TypeGuard[str]:
    """Whether ``value`` names a Hugging Face repo: an ``owner/name[@revision]`` string that is not an
    existing local path (a folder always wins)."""
    return (
        isinstance(value, str)
        and REPO_ID.fullmatch(value) is not None
        and not Path(value).expanduser().exists()
    )


def allow_patterns(card: ModelCard) -> list[str]:
    """The files ``card`` reads: each component's folder (or a top-level safetensors file it names) and
    ``model_index.json``; a card without a diffusers pipeline (a flat published layout) reads top-level
    files."""
    if card.pipeline is None:
        return list(SAFE)
    patterns = ["model_index.json"]
    for name, spec in card.components.items():
        sub = spec.subfolder or name
        patterns += [sub] if sub.endswith(".safetensors") else [f"{sub}/{p}" for p in SAFE]
    return patterns


def index_patterns(folder: Path) -> list[str]:
    """The files of the components ``folder/model_index.json`` lists (no index: every safe file)."""
    index = folder / "model_index.json"
    if not index.is_file():
        return list(SAFE)
    names = [
        k for k, v in json.loads(index.read_text()).items() if not k.startswith("_") and isinstance(v, list)
    ]
    return ["model_index.json", *(f"{name}/{p}" for name in names for p in SAFE)]


def snapshot(value: str, patterns: list[str]) -> Snapshot:
    """The local snapshot of the repo ``value`` (``owner/name[@revision]``) holding the files that match
    ``patterns``: from the cache, downloading what is missing when online. Pickles in it are refused."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    match = REPO_ID.fullmatch(value)
    if match is None:
        raise WeightsError(
            f"{value!r} is not a Hugging Face repo id. Fix: write it as owner/name[@revision]."
        )
    repo, revision = match["repo"], match["revision"] or "main"
    try:
        folder = snapshot_download(
            repo,
            revision=revision,
            allow_patterns=patterns,
            cache_dir=_cache_dir(),
            local_files_only=_offline(),
        )
    except GatedRepoError:
        raise WeightsError(
            f"Hugging Face repo {repo!r} is gated: its files need an accepted licence and a token. "
            f"Fix: accept its terms at https://huggingface.co/{repo} and log in (`hf auth login`)."
        ) from None
    except RepositoryNotFoundError:
        raise WeightsError(
            f"{value!r} is neither a local folder nor a Hugging Face model repo (or the repo is private). "
            f"Fix: check the folder path or the id at https://huggingface.co/{repo} (a private repo needs "
            "`hf auth login`)."
        ) from None
    except RevisionNotFoundError:
        raise WeightsError(
            f"Hugging Face repo {repo!r} has no revision {revision!r}. Fix: name an existing branch, tag "
            "or commit after '@', or drop '@...' for main."
        ) from None
    except LocalEntryNotFoundError:
        where = _cache_dir() or "the default Hugging Face cache"
        raise WeightsError(
            f"{value!r} is not a local folder and {repo}@{revision} is not in the Hugging Face cache "
            f"({where}), which is all fv can read while offline (HF_HUB_OFFLINE=1 or no connection). "
            f"Fix: {ONLINE_FIX}."
        ) from None
    path = Path(folder)
    refuse_pickles(path)
    return Snapshot(path, repo, revision, path.name)


def folder_snapshot(value: str) -> Snapshot:
    """The snapshot of a repo loaded without a card: its ``model_index.json`` first, then the files of
    the components it lists."""
    return snapshot(value, index_patterns(snapshot(value, ["model_index.json"]).folder))


def _cache_dir() -> str | None:
    """``HF_HUB_CACHE`` (else ``$HF_HOME/hub``) as set now: huggingface_hub reads them once, on import."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` as set now (read once on import by huggingface_hub)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
