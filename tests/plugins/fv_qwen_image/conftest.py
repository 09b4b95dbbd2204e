"""Session fixtures for fv-qwen-image: the tiny checkpoint (in a session fv cache, so the card's own
default weights are these), a folder of another shape, fv instances and diffusers' QwenImagePipeline."""

from __future__ import annotations

import pytest

import fv_core
from fv_core.plugins import PluginHost
from fv_qwen_image import plugin
from fv_qwen_image.tiny import tiny_weights, write_tiny_checkpoint

# 3 blocks of 3 heads x 8, rope axes (2, 2, 4), a 24-wide text encoder of 2 heads (mrope 2+2+2 = 12/2)
SECOND_SHAPE = dict(
    num_layers=3,
    num_attention_heads=3,
    attention_head_dim=8,
    joint_attention_dim=24,
    axes_dims_rope=(2, 2, 4),
)
SECOND_TEXT = dict(
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 2, 2]}
)


@pytest.fixture(scope="session")
def qwen_cache(tmp_path_factory):
    """FV_CACHE_DIR for the session: the tiny card's default weights are written here once."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("fv-cache")
    mp.setenv("FV_CACHE_DIR", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session")
def qwen_host() -> PluginHost:
    """Plugins as a fresh process has them: fv-qwen-image only (auto-loading stays off in tests)."""
    host = PluginHost(env={})
    host.add(plugin, "fv-qwen-image")
    return host.collect()


@pytest.fixture(scope="session")
def tiny_path(qwen_cache) -> str:
    return tiny_weights()


@pytest.fixture(scope="session")
def second_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen") / "qwen-second"
    write_tiny_checkpoint(path, transformer=SECOND_SHAPE, seed=7, text=SECOND_TEXT)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(qwen_host, tiny_path):
    return fv_core.load("qwen-image-tiny", tiny_path, host=qwen_host)


@pytest.fixture(scope="session")
def pipe(tiny_path):
    return pipeline(tiny_path)


def pipeline(folder: str):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- the edit cards ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def edit_path(qwen_cache) -> str:
    from fv_qwen_image.tiny import tiny_edit_weights

    return tiny_edit_weights()


@pytest.fixture(scope="session")
def edit_model(qwen_host, edit_path):
    return fv_core.load("qwen-image-edit-tiny", edit_path, host=qwen_host)


@pytest.fixture(scope="session")
def plus_second_path(tmp_path_factory) -> str:
    """An Edit Plus folder of the second shape (3 blocks of 3 heads x 8, a 24-wide text encoder)."""
    from fv_qwen_image.tiny import write_edit_checkpoint

    path = tmp_path_factory.mktemp("qwen") / "qwen-edit-plus-second"
    write_edit_checkpoint(path, "QwenImageEditPlusPipeline", SECOND_SHAPE, seed=7, text=SECOND_TEXT)
    return str(path)


@pytest.fixture(scope="session")
def plus_model(qwen_host, plus_second_path):
    return fv_core.load(plus_second_path, host=qwen_host)


def vl_processor(folder):
    """transformers' Qwen2VLProcessor of ``folder`` (a processor/ folder). Where torchvision is missing,
    transformers 5 can build no Qwen2-VL video processor (the edit pipelines never use one) and refuses a
    processor without one; it is then built with ``video_processor=None``, the class check skipped."""
    from unittest import mock

    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    try:
        return Qwen2VLProcessor.from_pretrained(folder)
    except ImportError:
        with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
            image, tokenizer = (
                AutoImageProcessor.from_pretrained(folder),
                AutoTokenizer.from_pretrained(folder),
            )
            return Qwen2VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=None)


def edit_pipeline(folder: str, plus: bool = False):
    """diffusers' QwenImageEditPipeline (QwenImageEditPlusPipeline) on ``folder``."""
    from pathlib import Path

    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = cls.from_pretrained(folder, processor=vl_processor(Path(folder) / "processor"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def picture(width: int, height: int, seed: int):
    """A random 8-bit RGB PIL image (smooth enough to survive resizing as a picture would)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    small = (rng.rand(max(2, height // 8), max(2, width // 8), 3) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)
