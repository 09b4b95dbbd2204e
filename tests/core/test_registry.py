import pytest

from fv_core.errors import DuplicateKeyError, UnknownKeyError
from fv_core.registry import Registry, lookup_kernel, resolve_lazy


def test_duplicate_key_names_both_plugins_until_one_is_enabled():
    reg = Registry("kernels")
    key = ("attention", "any", "any", "sta")
    reg.register(key, "collections:OrderedDict", "fv-sta")
    reg.register(key, "collections:OrderedDict", "fv-other")
    assert key in reg and key not in list(reg)  # known, but not usable
    with pytest.raises(DuplicateKeyError, match=r"\['fv-sta', 'fv-other'\].*FV_DISABLE_PLUGINS=fv-other"):
        reg.get(key)
    reg.settle({"fv-sta"})
    assert reg.plugin_of(("attention", "any", "any", "sta")) == "fv-sta"


def test_unknown_key_lists_available():
    reg = Registry("cards")
    reg.register("wan-a", object(), "p")
    reg.register("wan-b", object(), "p")
    with pytest.raises(UnknownKeyError, match="unknown cards key 'wan-c'. Available: 'wan-a', 'wan-b'"):
        reg.get("wan-c")


def test_lazy_values_import_on_first_use():
    reg = Registry("components")
    reg.register(("vae", "any", "default"), "collections:OrderedDict", "p")
    assert not reg.entries[("vae", "any", "default")].loaded
    from collections import OrderedDict

    assert reg.get(("vae", "any", "default")) is OrderedDict
    assert resolve_lazy("os.path:join.__name__") == "join"
    assert resolve_lazy("plain string") == "plain string"


def test_kernel_lookup_prefers_exact_device_and_arch():
    reg = Registry("kernels")
    reg.register(("attention", "any", "any", "sta"), "generic", "p")
    reg.register(("attention", "cuda", "sm90", "sta"), "hopper", "p")
    assert lookup_kernel(reg, "attention", "cuda", "sm90", "sta") == (
        ("attention", "cuda", "sm90", "sta"),
        "hopper",
    )
    assert lookup_kernel(reg, "attention", "cpu", "any", "sta")[1] == "generic"
    with pytest.raises(UnknownKeyError, match="no kernel for op 'attention' variant 'flash3'.*'sta'"):
        lookup_kernel(reg, "attention", "cpu", "any", "flash3")
