"""torch.compile(fullgraph=True) of a whole MoELayer forward: every op is a registered custom op with a fake
implementation, so Dynamo traces the block without a graph break."""

from __future__ import annotations

import pytest
import torch

from moefuse import MoEConfig, MoELayer
from moefuse.testing import assert_rel_close

CONFIG = MoEConfig(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2, num_shared_experts=1,
                   num_expert_group=2, topk_group=1, routed_scaling_factor=2.5)


@pytest.mark.parametrize("deferred", ["1", "0"], ids=["deferred", "not-deferred"])
def test_layer_compiles_without_graph_breaks(deferred, gen, monkeypatch):
    monkeypatch.setenv("MOEFUSE_ENABLE_DEFERRED_FINALIZE", deferred)
    torch._dynamo.reset()
    layer = MoELayer(CONFIG, dtype=torch.float32, backend="reference").init_random_(7, std=0.1)
    x = torch.randn(5, CONFIG.hidden_size, generator=gen)
    with torch.no_grad():
        want = layer(x)
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert_rel_close(got, want, 1e-6)


def test_ops_have_fake_implementations():
    # Every public op is a torch custom op: opcheck exercises its schema, fake tensor and dispatch registrations.
    ops = {name for name in dir(torch.ops.moefuse) if not name.startswith("_")}
    assert {"fused_gate", "finalize_fuse_shared"} <= ops
