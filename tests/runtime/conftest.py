import pytest

from tests.runtime.synthetic import DecodeLoop, DenoiseLoop, SyntheticModel


@pytest.fixture(scope="module")
def model() -> SyntheticModel:
    return SyntheticModel(seed=0)


@pytest.fixture(scope="module")
def denoise(model: SyntheticModel) -> DenoiseLoop:
    return DenoiseLoop(model)


@pytest.fixture(scope="module")
def decode(model: SyntheticModel) -> DecodeLoop:
    return DecodeLoop(model)
