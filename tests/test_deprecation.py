"""Renamed public names (moefuse._deprecation): the old name warns once per call, naming the new name and the
version it goes in, and does what the new one does. ``MoELayer.from_hf`` -> ``moefuse.from_hf`` (gone in 1.1)."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from hf_blocks import block

import moefuse
from moefuse import MoELayer
from moefuse._deprecation import deprecated_alias, resolve, warn_deprecated


def _calls_warnings(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and every warning it raised (none filtered away)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return result, caught


def test_moelayer_from_hf_warns_and_forwards(gen):
    hf_block = block("deepseek-v3", gen)
    new = moefuse.from_hf(hf_block, backend="reference")
    for _ in range(2):  # once per call, every call
        old, caught = _calls_warnings(MoELayer.from_hf, hf_block, backend="reference")
        assert [w.category for w in caught] == [DeprecationWarning]
        message = str(caught[0].message)
        assert "MoELayer.from_hf" in message and "moefuse.from_hf" in message and "1.1" in message
        assert caught[0].filename == __file__  # points at the caller, not at moefuse
    assert type(old) is MoELayer and old.backend == new.backend == "reference"
    assert old.config == new.config and old.quant == new.quant and old.activation_quant == new.activation_quant
    old_state, new_state = old.state_dict(), new.state_dict()
    assert old_state.keys() == new_state.keys()
    for name, tensor in new_state.items():  # both share the block's own tensors
        assert old_state[name].data_ptr() == tensor.data_ptr(), name
    x = torch.randn(5, old.config.hidden_size, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(old(x), new(x), rtol=0, atol=0)


def test_moelayer_from_hf_passes_errors_through():
    with pytest.warns(DeprecationWarning, match="moefuse.from_hf"), pytest.raises(TypeError):
        MoELayer.from_hf(torch.nn.Linear(2, 2), no_such_argument=1)


def test_deprecated_alias_function_and_method():
    old = deprecated_alias("moefuse.old_preset", "moefuse.preset", removed_in="1.1")
    assert old.__name__ == "old_preset" and "moefuse.preset" in (old.__doc__ or "")
    config, caught = _calls_warnings(old, "qwen3-30b-a3b")
    assert config == moefuse.preset("qwen3-30b-a3b")
    assert [w.category for w in caught] == [DeprecationWarning] and caught[0].filename == __file__
    assert str(caught[0].message) == ("moefuse.old_preset is deprecated and will be removed in moefuse 1.1; "
                                      "use moefuse.preset instead")

    class Holder:
        old = classmethod(deprecated_alias("Holder.old", "moefuse.preset", removed_in="2.0", method=True))

    config, caught = _calls_warnings(Holder.old, "glm-4.5-air")  # the class is dropped before forwarding
    assert config == moefuse.preset("glm-4.5-air") and len(caught) == 1 and caught[0].filename == __file__
    assert "2.0" in str(caught[0].message)


def test_warn_deprecated_points_at_the_callers_caller():
    def old_api():
        warn_deprecated("old_api", "new_api", "1.1")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        old_api()
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_resolve():
    assert resolve("moefuse.from_hf") is moefuse.from_hf
    assert resolve("moefuse.hf.from_hf") is moefuse.from_hf
    assert resolve("moefuse.layer.MoELayer.from_hf").__func__ is MoELayer.from_hf.__func__
    with pytest.raises(AttributeError):
        resolve("moefuse.no_such_name")
    with pytest.raises(ModuleNotFoundError):
        resolve("no_such_package_moefuse.thing")


@pytest.mark.parametrize("module, old, new", [
    ("moefuse.layer", "moe_layer_torch", "moefuse.reference.moe_layer_torch"),
    ("moefuse.experts", "launch_variant", "moefuse.experts.op.launch_variant"),
    ("moefuse.experts", "cublas_mlp", "moefuse.experts.op.cublas_mlp"),
    ("moefuse.experts", "mxfp4_ws", "moefuse.experts.mxfp4.ws"),
    ("moefuse.experts", "fp8_mlp", "moefuse.experts.fp8.mlp"),
])
def test_moved_names_warn_and_resolve(module, old, new):
    """Names that moved out of a module in 1.0 still resolve there until 1.1, each read warning with the new name."""
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated .* 1\.1; use {new} instead"):
        got = getattr(sys.modules.get(module) or resolve(module), old)
    assert got is resolve(new)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = resolve(module).not_a_name
