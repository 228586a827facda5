"""A token's output does not depend on the batch it runs in (issue 37): alone, in a batch of 37 and in a batch of
600 (the layer's tile height changes between them: 16-row tiles at one token, 128-row tiles at 600), in every
weight format and activation precision the layer runs, against the format's tolerance (``tolerances.py``). The
precision never changes with the batch: MXFP4 runs W4A16 at every size unless ``activation_quant="fp8"`` asks
for W4A8 at every size. Kernels run compiled on a GPU and through the interpreter on CPU (a smaller large batch
there: the interpreter is slow, and 160 tokens already take the 64- and 128-row tiles)."""

from __future__ import annotations

import pytest
import torch
from tolerances import experts_tolerance

from moefuse import MoELayer
from moefuse.config import MoEConfig
from moefuse.experts import plan_block_m
from moefuse.testing import rel_error

GPU = torch.cuda.is_available()
HOPPER = GPU and torch.cuda.get_device_capability() == (9, 0)
BATCHES = (37, 600) if GPU else (37, 160)
# H and I multiples of 128 (W4A8 takes no other), a shared expert (fp8 with quantized layers)
CONFIG = MoEConfig(256, 128, 8, 2, num_shared_experts=1, routed_scaling_factor=1.5, swiglu_limit=7.0)


@pytest.mark.parametrize("quant, activation_quant, fmt", [
    (None, "default", "bf16"),
    ("fp8", "default", "fp8"),
    ("mxfp4", "default", "mxfp4"),
    pytest.param("mxfp4", "fp8", "w4a8", marks=pytest.mark.skipif(not HOPPER, reason="W4A8 runs on sm_90 only")),
])
def test_token_output_is_batch_invariant(quant, activation_quant, fmt, device):
    layer = MoELayer(CONFIG, quant=quant, activation_quant=activation_quant, device=device, backend="triton")
    layer.init_random_(seed=5, std=0.08)
    gen = torch.Generator().manual_seed(11)
    token = torch.randn(1, CONFIG.hidden_size, generator=gen).bfloat16().to(device)
    weight = layer.experts.weights()[0]
    heights = {plan_block_m(M, weight, CONFIG.top_k, token.dtype, activation_quant, arch=None if not GPU else "auto")
               for M in (1, *BATCHES)}
    assert len(heights) > 1 or fmt == "w4a8", f"the batches should take different tile heights, got {heights}"
    with torch.no_grad():
        alone = layer(token)[0]
        for M in BATCHES:
            batch = torch.randn(M, CONFIG.hidden_size, generator=gen).bfloat16().to(device)
            at = M // 3
            batch[at] = token[0]
            got = layer(batch)[at]
            # Tall tiles sum in another order (and, fp8, with wgmma's fewer bits) than 16-row ones: each path is
            # within the format's tolerance of float64, so the two are within it of each other.
            tol = experts_tolerance(fmt, 128)[0]
            err = rel_error(got, alone)
            assert err <= tol, f"{fmt}: token alone vs in a batch of {M}: relative difference {err:.2e} > {tol:.0e}"
