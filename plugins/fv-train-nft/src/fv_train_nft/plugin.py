"""fv-train-nft's pluggy hooks: the ``nft`` method, its option schema, a ``constant`` reward (the
control run's: every sample scores the same, so no advantage reaches the policy) and
``shapes-position-debiased`` (the shapes-detector score less what the start position predicts)."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl

PLUGIN = "fv-train-nft"


@hookimpl
def fv_register_methods(register: Callable[..., None]) -> None:
    register("nft", "fv_train_nft.method:NftMethod")


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    register(PLUGIN, "fv_train_nft.config:NftOptions")  # lazy: imported when a deploy or load reads it


@hookimpl
def fv_register_rewards(register: Callable[..., None]) -> None:
    register("constant", "fv_train_nft.rewards:ConstantReward")
    register("shapes-position-debiased", "fv_train_nft.rewards:PositionDebiasedShapesReward")
