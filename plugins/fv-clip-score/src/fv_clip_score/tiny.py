"""A random-weight CLIP in the published layout (config, ``model.safetensors``, tokenizer and image
processor files), for tests: every scorer path runs as it does on ``openai/clip-vit-base-patch32``."""

from __future__ import annotations

from pathlib import Path

import torch

START, END = "<|startoftext|>", "<|endoftext|>"


def _byte_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE maps bytes to (printable bytes map to themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [256 + i for i in range(256 - len(printable))]
    return [chr(c) for c in printable + shifted]


def write_tiny_clip(folder: Path, seed: int = 0, image_size: int = 32) -> Path:
    """Write a tiny random CLIP (character-level vocabulary, no merges) to ``folder``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    chars = _byte_alphabet()
    tokens = [*chars, *(c + "</w>" for c in chars), START, END]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    width = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    text = dict(width, vocab_size=len(vocab), max_position_embeddings=77)
    text |= dict(bos_token_id=vocab[START], eos_token_id=vocab[END], pad_token_id=vocab[END])
    config = CLIPConfig(
        text_config=text, vision_config=dict(width, image_size=image_size, patch_size=8), projection_dim=16
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(folder)
    size = {"height": image_size, "width": image_size}
    images = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size=size)
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return Path(folder)
