"""C0 parity of BAGEL's pieces: the understanding expert is transformers' Qwen3 decoder (per-head q/k
norm, attention bias on) on the same weights; the generation expert is the same code on its own
weights; the FLUX autoencoder is diffusers' AutoencoderKL; KV-cached decode and ragged batches equal
a full-sequence forward and solo rows bit for bit (fp32, exact math)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fv_bagel.bodies import text_body
from fv_bagel.checkpoint import check_layout, load_net
from fv_bagel.context import padded
from fv_core import WeightsError


@pytest.fixture(scope="module")
def net(bagel_path):
    return load_net(Path(bagel_path), torch.float32, torch.device("cpu"))


def qwen3_with(lm, suffix: str = ""):
    """transformers' Qwen3Model holding one expert's weights of the MoT language model."""
    from transformers import Qwen3Config, Qwen3Model

    c = lm.config
    config = Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_parameters["rope_theta"], attention_bias=True,
        max_position_embeddings=c.max_position_embeddings,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    ref = Qwen3Model(config).eval()
    state = {
        "embed_tokens.weight": lm.model.embed_tokens.weight,
        "norm.weight": getattr(lm.model, "norm" + suffix).weight,
    }
    for i, layer in enumerate(lm.model.layers):
        a = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            for p in ("weight", "bias"):
                state[f"layers.{i}.self_attn.{name}.{p}"] = getattr(getattr(a, name + suffix), p)
        state[f"layers.{i}.self_attn.o_proj.weight"] = getattr(a, "o_proj" + suffix).weight
        state[f"layers.{i}.self_attn.o_proj.bias"] = torch.zeros(c.hidden_size)  # BAGEL's o_proj has none
        for name in ("q_norm", "k_norm"):
            state[f"layers.{i}.self_attn.{name}.weight"] = getattr(a, name + suffix).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[f"layers.{i}.mlp.{name}.weight"] = getattr(getattr(layer, "mlp" + suffix), name).weight
        for name in ("input_layernorm", "post_attention_layernorm"):
            state[f"layers.{i}.{name}.weight"] = getattr(layer, name + suffix).weight
    ref.load_state_dict(state, strict=True)
    return ref


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("expert", ["und", "gen"])
def test_each_expert_equals_transformers_qwen3_decoder(net, exact, expert):
    lm = net.language_model
    suffix = "_moe_gen" if expert == "gen" else ""
    ref = qwen3_with(lm, suffix)
    ids = torch.randint(0, lm.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(11)[None].expand(2, -1)
    with torch.no_grad():
        expected = ref(input_ids=ids, position_ids=pos).last_hidden_state
        gen = (
            torch.ones_like(ids, dtype=torch.bool) if expert == "gen" else None
        )  # every token on that expert
        mask = torch.ones(11, 11, dtype=torch.bool).tril()
        got, _, _ = lm(net.embed_tokens(ids), pos, mask, gen=gen, exact=exact)
    # SDPA math equals transformers' to the bit; the row-invariant sums differ in summation order only
    assert (got - expected).abs().max().item() <= (1e-5 if exact else 1e-6)


def test_tokens_route_to_their_expert_inside_one_sequence(net):
    """Mixed routing: a token's own projections come from its expert (changing the other expert's
    weights leaves an und-only prefix's keys unchanged), and attention mixes both."""
    lm = net.language_model
    h = torch.randn(1, 6, lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.zeros(1, 6, dtype=torch.long)
    gen = torch.tensor([[False, True, True, True, True, False]])
    full = torch.ones(6, 6, dtype=torch.bool)
    with torch.no_grad():
        out, k, _ = lm(h, pos, full, gen=gen, exact=True)
        und_only, k_und, _ = lm(h, pos, full, exact=True)
    assert torch.equal(k[:, 0, :, 0], k_und[:, 0, :, 0])  # layer 0 keys of an und token: same weights
    assert not torch.equal(k[:, 0, :, 1], k_und[:, 0, :, 1])  # a gen token's keys: the other expert's
    assert not torch.equal(out[:, 0], und_only[:, 0])  # and attention lets the und token see them


def test_kv_cached_decode_equals_a_full_sequence_forward_bit_for_bit(net):
    lm = net.language_model
    layers, kvh, d = lm.kv_shape
    ids = torch.randint(0, lm.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mask = torch.ones(13, 13, dtype=torch.bool).tril()
        h, k_full, v_full = lm(net.embed_tokens(ids), torch.arange(13)[None], mask, exact=True)
        logits_full = (h.unsqueeze(-2) * lm.lm_head.weight).sum(-1)[0]
        ctx = {"k": torch.zeros(layers, kvh, 0, d), "v": torch.zeros(layers, kvh, 0, d)}
        prefix = 5
        out = text_body(
            net, True, True, {"ids": ids[:, :prefix], "pos": torch.arange(prefix)[None], **padded([ctx], 16)}
        )
        ctx = {"k": out["k"][0], "v": out["v"][0]}
        logits = [out["logits"][0]]
        for i in range(prefix, 13):
            size = 16 * (1 + i // 16) + 16 * (i % 2)  # padding of any length leaves the rows' bits alone
            out = text_body(
                net, True, True, {"ids": ids[:, i : i + 1], "pos": torch.tensor([[i]]), **padded([ctx], size)}
            )
            ctx = {"k": torch.cat([ctx["k"], out["k"][0]], 2), "v": torch.cat([ctx["v"], out["v"][0]], 2)}
            logits.append(out["logits"][0])
    assert torch.equal(ctx["k"], k_full[0]) and torch.equal(ctx["v"], v_full[0])
    assert torch.equal(torch.stack(logits), logits_full[prefix - 1 :])


def test_ragged_rows_in_one_call_equal_each_row_alone(net):
    lm = net.language_model
    layers, kvh, d = lm.kv_shape
    g = torch.Generator().manual_seed(3)
    contexts = [{"k": torch.randn(layers, kvh, n, d, generator=g), "v": torch.randn(layers, kvh, n, d, generator=g)}
                for n in (3, 17, 9)]  # fmt: skip
    ids, pos = torch.tensor([[5], [7], [9]]), torch.tensor([[3], [17], [9]])
    with torch.no_grad():
        together = text_body(net, True, True, {"ids": ids, "pos": pos, **padded(contexts, 32)})
        for r, ctx in enumerate(contexts):
            alone = text_body(
                net,
                True,
                True,
                {"ids": ids[r : r + 1], "pos": pos[r : r + 1], **padded([ctx], 16 + 16 * (r == 1))},
            )
            for name in ("logits", "k", "v"):
                assert torch.equal(together[name][r], alone[name][0]), (r, name)


def test_flux_vae_loads_bfl_keys_into_diffusers_autoencoderkl(tmp_path):
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    from fv_bagel.vae import FLUX_CONFIG, config_from_state, flux_config, load_flux_vae, to_bfl

    torch.manual_seed(0)
    config = flux_config([32, 32, 64, 64], 2)
    reference = AutoencoderKL(**config).eval()
    bfl = to_bfl(reference.state_dict(), 4)
    assert "encoder.mid.attn_1.q.weight" in bfl and "decoder.up.3.upsample.conv.weight" in bfl
    assert config_from_state(bfl) == config and FLUX_CONFIG["block_out_channels"] == [128, 256, 512, 512]
    save_file(bfl, str(tmp_path / "ae.safetensors"))
    vae = load_flux_vae(tmp_path / "ae.safetensors")
    loaded = vae.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in reference.state_dict().items())
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        assert torch.equal(z, reference.encode(x).latent_dist.mode())
        assert torch.equal(vae.decode(z).sample, reference.decode(z).sample)


def test_the_loader_refuses_pickles_and_names_missing_files(tmp_path, bagel_path):
    (tmp_path / "ema.bin").write_bytes(b"x")
    with pytest.raises(WeightsError, match="refusing pickle"):
        check_layout(tmp_path)
    (tmp_path / "ema.bin").unlink()
    with pytest.raises(WeightsError, match="ema.safetensors is missing"):
        check_layout(tmp_path)
    folder = check_layout(bagel_path, vae=True)
    assert {p.name for p in folder.iterdir()} >= {
        "ema.safetensors", "ae.safetensors", "llm_config.json", "vit_config.json", "tokenizer.json",
        "tokenizer_config.json", "vocab.json", "merges.txt",
    }  # fmt: skip


def test_the_7b_card_loads_the_published_layout_in_bfloat16(tmp_path, bagel_host, bagel_path):
    """The same files with the keys BAGEL's llm_config.json carries (its own and its training run's):
    the bagel-7b-mot card (bfloat16, SDPA math) loads and runs them."""
    import json
    import shutil

    import fv_core

    folder = tmp_path / "published"
    shutil.copytree(bagel_path, folder)
    config = json.loads((folder / "llm_config.json").read_text())
    config.update(qk_norm=True, layer_module="Qwen2MoTDecoderLayer", freeze_und=False, is_causal=True,
                  _attn_implementation="flash_attention_2", torch_dtype="bfloat16")  # fmt: skip
    (folder / "llm_config.json").write_text(json.dumps(config))
    model = fv_core.load("bagel-7b-mot", folder, host=bagel_host)
    answer = model.generate(task="chat", prompt="hello", max_tokens=3)
    assert model.instance.net.vae2llm.weight.dtype == torch.bfloat16 and not model.instance.exact
    assert answer.provenance["deploy"]["precision"] == "bfloat16"
    image = model.generate(task="t2i", prompt="a cat", height=32, width=32, num_inference_steps=2)
    assert image.image.shape == (32, 32, 3)
    config["layer_module"] = "Qwen2DecoderLayer"
    (folder / "llm_config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="MoT"):
        fv_core.load("bagel-7b-mot", folder, host=bagel_host)


def test_a_file_without_the_frozen_position_tables_gets_them_computed(tmp_path, bagel_path, net):
    """The two sin-cos tables are frozen parameters a checkpoint may leave out; they are computed as BAGEL
    initialises them (the tiny's were written from the same function), any other missing key is an error."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "no-tables"
    shutil.copytree(bagel_path, folder)
    state = load_file(str(folder / "ema.safetensors"))
    del state["latent_pos_embed.pos_embed"], state["vit_pos_embed.pos_embed"]
    save_file(state, str(folder / "ema.safetensors"))
    loaded = load_net(folder, torch.float32, torch.device("cpu"))
    assert loaded.max_latent_size == 64 and loaded.vit_side == 70  # BAGEL's sizes when the file has none
    assert torch.equal(loaded.latent_pos_embed.pos_embed[:1], net.latent_pos_embed.pos_embed[:1])
    del state["vae2llm.bias"]
    save_file(state, str(folder / "ema.safetensors"))
    with pytest.raises(WeightsError, match="vae2llm.bias"):
        load_net(folder, torch.float32, torch.device("cpu"))


def test_position_tables_are_sin_cos_at_integer_grid_positions():
    from fv_bagel.mot import sincos_2d

    hidden, side = 16, 5
    table = sincos_2d(hidden, side)
    w = 10000.0 ** (-torch.arange(hidden // 4, dtype=torch.float64) / (hidden // 4))
    for r, c in ((0, 0), (1, 3), (4, 2)):
        want = torch.cat([torch.sin(c * w), torch.cos(c * w), torch.sin(r * w), torch.cos(r * w)]).float()
        assert torch.allclose(table[r * side + c], want, atol=1e-6), (r, c)


def test_timestep_features_are_cos_then_sin_of_t_times_geometric_frequencies(net):
    """The embedder's input: ``[cos(t f), sin(t f)]``, ``f_i = 10000^(-i / 128)``, t the flow time in 0..1."""
    from fv_bagel.mot import linear

    te = net.time_embedder
    t = torch.tensor([0.0, 0.37, 1.0])
    f = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(128) / 128)
    feats = torch.cat([torch.cos(t[:, None] * f), torch.sin(t[:, None] * f)], dim=-1)
    want = linear(torch.nn.functional.silu(linear(feats, te.mlp[0], False)), te.mlp[2], False)
    assert torch.allclose(te(t), want, atol=1e-6)


def test_grouped_decode_attention_equals_sdpa_over_repeated_heads():
    """The decode path's in-place grouped attention == SDPA over keys/values repeated per query head."""
    import torch.nn.functional as F

    from fv_bagel.mot import grouped_attend

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, *shape, generator=gen) for shape in ((8, 1, 16), (2, 20, 16), (2, 20, 16)))
    keep = torch.arange(20)[None, None, None] < torch.tensor([5, 12, 20])[:, None, None, None]
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=keep
    )
    assert (grouped_attend(q, k, v, keep) - want).abs().max() <= 1e-6
