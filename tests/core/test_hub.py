"""Hugging Face repo ids as weights, against a local cache laid out as huggingface_hub lays it out
(``models--owner--name/{refs,snapshots,blobs}``), offline: nothing here downloads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import types
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

import fv_core
from fv_core.cli import main
from fv_core.extend import hookimpl
from fv_core.hub import allow_patterns, is_repo_id
from fv_core.plugins import PluginHost

REPO = "fv-test/wan-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PUBLISHED = "wan-tiny-published"  # a card naming REPO as its weights_repo, with no embedded weights


def cache_repo(cache: Path, repo: str, source: Path, commit: str = COMMIT, extra: dict | None = None) -> Path:
    """``source``'s files as huggingface_hub caches ``repo`` at ``commit`` (refs/main -> commit; the
    snapshot's files are relative links into blobs/ named by content hash); ``extra``: more files."""
    store = cache / f"models--{repo.replace('/', '--')}"
    snapshot = store / "snapshots" / commit
    files = {str(p.relative_to(source)): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    for name, data in {**files, **(extra or {})}.items():
        blob = store / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (store / "refs").mkdir(exist_ok=True)
    (store / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> Path:
    from fv_wan.tiny import tiny_weights

    cache = tmp_path_factory.mktemp("hf-hub")
    cache_repo(cache, REPO, Path(tiny_weights()))
    return cache


@pytest.fixture
def offline(hf_cache, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_cache


@pytest.fixture(scope="module")
def hub_host() -> PluginHost:
    """fv-wan, and a card like wan2.1-t2v-tiny whose weights are REPO's (none embedded)."""
    from fv_wan import plugin
    from fv_wan.cards import card

    published = card("wan2.1-t2v-tiny").model_copy(
        update={"model_id": PUBLISHED, "default_weights": None, "weights_repo": REPO}
    )
    cards = types.SimpleNamespace(fv_register_cards=hookimpl(lambda register: register(published)))
    host = PluginHost(env={})
    host.add(plugin, "fv-wan")
    host.add(cards, "fv-published")
    return host.collect()


def test_a_repo_id_is_owner_slash_name_and_a_local_folder_wins(tmp_path, monkeypatch):
    assert is_repo_id("Wan-AI/Wan2.1-T2V-1.3B-Diffusers") and is_repo_id("owner/name@v1.0")
    assert not is_repo_id("wan2.1-t2v-tiny") and not is_repo_id("a/b/c") and not is_repo_id(Path("a/b"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not is_repo_id("owner/name")


def test_the_published_cards_name_their_repos():
    from fv_bagel.cards import bagel_7b_mot, bagel_tiny
    from fv_ltx2.cards import ltx2_dev, ltx2_tiny
    from fv_wan.cards import ROWS, card

    assert card("wan2.1-t2v-1.3b").weights_repo == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert card("fastwan2.1-t2v-1.3b").weights_repo == "FastVideo/FastWan2.1-T2V-1.3B-Diffusers"
    published = [r.id for r in ROWS.values() if r.repo is not None]
    assert len(published) == 8 and all(ROWS[i].weights is None for i in published)
    assert ltx2_dev().weights_repo == "Lightricks/LTX-2" and ltx2_tiny().weights_repo is None
    assert bagel_7b_mot().weights_repo == "ByteDance-Seed/BAGEL-7B-MoT" and bagel_tiny().weights_repo is None


def test_allow_patterns_fetch_only_the_files_the_card_reads():
    from fv_bagel.cards import bagel_7b_mot
    from fv_ltx2.cards import ltx2_dev
    from fv_wan.cards import card

    repo = [
        "model_index.json",
        "README.md",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.bin",
        "tokenizer/spiece.model",
        "text_encoder/pytorch_model.pt",
        "examples/i2v_input.JPG",
        "ltx-2-19b-dev.safetensors",
        "ltx-2-19b-distilled-lora-384.safetensors",
        "ema.safetensors",
        "llm_config.json",
        "merges.txt",
        "ema.pkl",
    ]

    def fetched(card):
        return set(filter_repo_objects(repo, allow_patterns=allow_patterns(card)))

    wan = {"model_index.json", "transformer/config.json", "tokenizer/spiece.model"}
    assert fetched(card("wan2.1-t2v-1.3b")) == wan | {repo[3]}
    assert fetched(ltx2_dev()) == wan | {repo[3], "ltx-2-19b-distilled-lora-384.safetensors"}
    flat = {"ema.safetensors", "llm_config.json", "merges.txt"}
    assert flat <= fetched(bagel_7b_mot()) and not {"ema.pkl", "README.md"} & fetched(bagel_7b_mot())


def test_load_by_id_from_the_offline_cache(offline, hub_host, tmp_path):
    record = {"repo": REPO, "revision": "main", "commit": COMMIT}
    model = fv_core.load(weights=REPO, host=hub_host)  # the card built from the snapshot's configs
    assert model.card.pipeline == "WanPipeline" and model.weights_repo == {**record, "path": model.weights}
    assert Path(model.weights) == offline / "models--fv-test--wan-tiny" / "snapshots" / COMMIT
    named = fv_core.load("wan2.1-t2v-tiny", f"{REPO}@main", host=hub_host)
    assert named.card.model_id == "wan2.1-t2v-tiny" and named.weights == model.weights
    published = fv_core.load(PUBLISHED, host=hub_host)  # no weights given: its weights_repo
    assert published.weights_repo == model.weights_repo
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"plugins: [fv-wan]\nmodels:\n  - card: wan2.1-t2v-tiny\n    weights: {REPO}\n")
    assert fv_core.load(deploy=deploy, host=hub_host).weights_repo == model.weights_repo


def test_the_cli_generates_from_ids(offline, hub_host, tmp_path, monkeypatch):
    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: hub_host)
    request = ["--prompt", "a cat", "--steps", "1", "--size", "32x32", "--frames", "5"]
    for name, model in (
        ("a", ["--model", "wan2.1-t2v-tiny", "--weights", REPO]),
        ("b", ["--model", PUBLISHED]),
    ):
        out = tmp_path / f"{name}.mp4"
        assert main(["generate", *model, *request, "-o", str(out)]) == 0
        prov = json.loads(out.with_suffix(".json").read_text())
        assert prov["weights_repo"]["repo"] == REPO and prov["weights_repo"]["commit"] == COMMIT
        assert prov["weights"] == prov["weights_repo"]["path"]


def test_an_id_not_in_the_cache_while_offline_names_the_fix(offline, hub_host, capsys):
    with pytest.raises(
        fv_core.WeightsError, match="'fv-test/absent' is not a local folder and fv-test/absent@main"
    ):
        fv_core.load(weights="fv-test/absent", host=hub_host)
    with pytest.raises(fv_core.WeightsError, match="Fix: run once with a connection"):
        fv_core.load("wan2.1-t2v-tiny", f"{REPO}@v2", host=hub_host)  # a revision the cache lacks
    assert main(["generate", "--weights", "fv-test/absent", "--prompt", "a cat"]) == 2
    assert "not in the Hugging Face cache" in capsys.readouterr().err


def test_a_cached_snapshot_holding_a_pickle_is_refused(offline, hub_host):
    source = offline / "models--fv-test--wan-tiny" / "snapshots" / COMMIT
    cache_repo(offline, "fv-test/pickled", source, extra={"transformer/diffusion_pytorch_model.bin": b"x"})
    with pytest.raises(fv_core.WeightsError, match="refusing pickle.*diffusion_pytorch_model.bin"):
        fv_core.load("wan2.1-t2v-tiny", "fv-test/pickled", host=hub_host)
    shutil.rmtree(offline / "models--fv-test--pickled")
