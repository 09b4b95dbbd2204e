"""The Wan VAE's RMS norms: diffusers' own on a call of one video (bit for bit), the fast form on a
call of several (equal within rounding), and a batch's decode within the card's batched tolerance."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

from fv_wan.bodies import decode_body
from fv_wan.vae_norm import BatchRMSNorm


@pytest.mark.parametrize("channel_first", [True, False])
def test_the_fast_form_equals_diffusers_norm(channel_first):
    ours, theirs = (cls(8, channel_first=channel_first, images=False) for cls in (BatchRMSNorm, WanRMS_norm))
    with torch.no_grad():
        theirs.gamma.normal_()
        ours.load_state_dict(theirs.state_dict())
    shape = (3, 8, 2, 5, 5) if channel_first else (3, 2, 5, 5, 8)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(x[:1]), theirs(x[:1]))  # one video: diffusers' own computation
        assert (ours(x) - theirs(x)).abs().max() <= 1e-6
        assert (ours(x.bfloat16()).float() - theirs(x.bfloat16()).float()).abs().max() <= 2e-2


def test_a_batch_decode_takes_the_fast_norms_within_tolerance(tiny_model):
    vae = tiny_model.component("vae")
    norms = [m for m in vae.modules() if isinstance(m, WanRMS_norm)]
    assert norms and all(type(m) is BatchRMSNorm for m in norms)
    z = torch.randn(2, 16, 2, 4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        both = decode_body(vae, {"latents": z})["frames"]
        alone = torch.cat([decode_body(vae, {"latents": z[i : i + 1]})["frames"] for i in range(2)])
    assert (both - alone).abs().max() <= tiny_model.card.parity.tolerances["frames_batched_cfg"]
