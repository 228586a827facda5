"""``research/l2_prefetch.py`` (a layer-level candidate for fp8 decode: the shared expert's weights asked of the L2
while the router chain runs). The prefetch is inline PTX, which the interpreter cannot run: on a GPU the layer keeps its
bits with it, at every launch the probe times; everywhere, arguments are checked before a launch."""
import pytest
import torch

from moefuse import MoELayer
from moefuse.config import preset
from research import l2_prefetch
from research.tests.cases import DEVICE


def test_a_strided_tensor_is_refused_before_a_launch():
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch.prefetch_into_l2([torch.zeros(8, 8, device=DEVICE).t()], programs=1, evict_last=False)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="inline PTX: compiled kernels only")
@pytest.mark.parametrize("programs,evict_last", [(1, False), (8, True)])
def test_the_layer_keeps_its_bits_with_the_shared_expert_prefetched(programs, evict_last):
    cfg = preset("deepseek-v3").scaled(hidden_size=512, intermediate_size=256, num_experts=16)
    # no self-captured graphs: a graph captured before the wrapper would replay without it
    layer = MoELayer(cfg, device=DEVICE, quant="fp8", shared_slot_max_tokens=8,
                     graph_max_tokens=0).init_random_(seed=0)
    x = torch.randn(3, cfg.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    assert layer.uses_shared_slot(3, DEVICE)
    with torch.no_grad():
        want = layer(x)
        undo = l2_prefetch.with_shared_prefetch(layer, programs, evict_last)
        got = layer(x)
        undo()
    assert torch.equal(got, want)
    assert "_forward_shared_slot" not in vars(layer), "undo left the wrapper on the layer"
