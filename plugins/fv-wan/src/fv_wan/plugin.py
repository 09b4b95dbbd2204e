"""fv-wan's pluggy hooks (entry point ``fv.plugins: fv-wan``). Everything is lazy: no torch model
code is imported until a card is loaded."""

from __future__ import annotations

from fv_core.extend import hookimpl

CARDS = {
    "wan2.1-t2v-tiny": "fv_wan.cards:wan_tiny",
    "wan2.1-t2v-shapes": "fv_wan.cards:wan_shapes",
    "wan2.1-t2v-shapes-1step": "fv_wan.cards:wan_shapes_1step",
    "wan2.1-t2v-shapes-2step": "fv_wan.cards:wan_shapes_2step",
    "wan2.1-t2v-shapes-nft": "fv_wan.cards:wan_shapes_nft",
    "wan2.1-t2v-1.3b": "fv_wan.cards:wan_1_3b",
    "wan2.1-t2v-14b": "fv_wan.cards:wan_14b",
    "fastwan2.1-t2v-1.3b": "fv_wan.cards:fastwan_1_3b",
    "wan2.1-i2v-tiny": "fv_wan.cards:wan21_i2v_tiny",
    "wan2.2-ti2v-tiny": "fv_wan.cards:wan22_ti2v_tiny",
    "wan2.2-t2v-a14b-tiny": "fv_wan.cards:wan22_t2v_a14b_tiny",
    "wan2.2-i2v-a14b-tiny": "fv_wan.cards:wan22_i2v_a14b_tiny",
    "wan2.1-i2v-14b-480p": "fv_wan.cards:wan21_i2v_480p",
    "wan2.1-i2v-14b-720p": "fv_wan.cards:wan21_i2v_720p",
    "wan2.2-ti2v-5b": "fv_wan.cards:wan22_ti2v_5b",
    "wan2.2-t2v-a14b": "fv_wan.cards:wan22_t2v_a14b",
    "wan2.2-i2v-a14b": "fv_wan.cards:wan22_i2v_a14b",
    "wan2.1-t2v-tiny-causal": "fv_wan.cards:wan_tiny_causal",
    "wan2.1-t2v-shapes-causal": "fv_wan.cards:wan_shapes_causal",
    "wan2.1-t2v-shapes-causal-long": "fv_wan.cards:wan_shapes_causal_long",
}


@hookimpl
def fv_register_cards(register) -> None:
    for model_id, factory in CARDS.items():
        register(model_id, factory)


@hookimpl
def fv_register_trainers(register) -> None:
    register("wan", "fv_wan.training:WanTrainAdapter")


@hookimpl
def fv_register_pipelines(register) -> None:
    register("WanPipeline", "fv_wan.folder:WanFolder")
    register("WanImageToVideoPipeline", "fv_wan.folder:WanFolder")
