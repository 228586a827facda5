"""The whole MoE block computed plainly: the layer's test oracle, composed of each stage's reference.

Each stage keeps its PyTorch reference beside its kernels (``route/reference.py``, ``dispatch/reference.py``,
``experts/reference.py``, ``finalize/reference.py``). :func:`moe_layer_torch` chains the router's and the experts'
references over a :class:`moefuse.MoELayer`'s weights, in float64 by default, with no dispatch plan, grouped GEMM or
finalize kernel in between: what a layer's output is checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefuse.experts.reference import expert_mlp_torch
from moefuse.layer import MoELayer
from moefuse.route.reference import hash_gate_torch, moe_fused_gate_torch


@torch.no_grad()
def moe_layer_torch(layer: MoELayer, hidden_states: torch.Tensor, num_token_non_padded: int | None = None, *,
                    dtype: torch.dtype = torch.float64, route_dtype: torch.dtype | None = None,
                    input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The block computed plainly in ``dtype`` (float64 by default) from ``layer``'s weights: the test oracle.

    Routes with the router reference in ``route_dtype`` (default ``dtype``), then runs each touched expert
    densely on its tokens: no dispatch, no grouped GEMM, no finalize kernel. Returns [..., H] in ``dtype``.
    Pass ``route_dtype=torch.float32`` to judge a bf16 layer on the experts' arithmetic alone: a token whose
    k-th and (k+1)-th keys differ by less than fp32 rounding may otherwise pick another expert.
    """
    c = layer.config
    x = hidden_states.reshape(-1, c.hidden_size).to(dtype)
    rdtype = dtype if route_dtype is None else route_dtype
    logits = F.linear(x.to(rdtype), layer.gate.weight.to(rdtype))
    bias = layer.gate.e_score_correction_bias
    if layer.gate.tid2eid is not None:
        if input_ids is None:
            raise ValueError("a hash-routed layer needs input_ids (the token ids of hidden_states)")
        weights, ids = hash_gate_torch(logits, layer.gate.tid2eid[input_ids.reshape(-1)], c.scoring_func,
                                       renormalize=c.renormalize, routed_scaling_factor=c.routed_scaling_factor,
                                       num_token_non_padded=num_token_non_padded, dtype=rdtype)
    else:
        weights, ids = moe_fused_gate_torch(
            logits, bias, c.top_k, c.scoring_func, renormalize=c.renormalize,
            routed_scaling_factor=c.routed_scaling_factor, apply_routed_scaling_factor_on_output=True,
            num_expert_group=c.num_expert_group, topk_group=c.topk_group, moe_softcapping=c.moe_softcapping,
            num_token_non_padded=num_token_non_padded, dtype=rdtype,
        )
    out = torch.zeros_like(x)
    gate_up, down = layer.experts.weights()
    for expert in ids.unique().tolist():
        if not 0 <= expert < c.num_experts:
            continue
        token, slot = (ids == expert).nonzero(as_tuple=True)
        y = expert_mlp_torch(x[token], gate_up[expert], down[expert], c.swiglu_limit, layer.activation_dtype, dtype,
                             layer.activation_quant)
        out.index_add_(0, token, y * weights[token, slot].to(dtype)[:, None])
    if layer.shared_experts is not None:
        if layer.shared_format.quantized:
            gate_up_s, down_s = layer.shared_weights()
            out += expert_mlp_torch(x, gate_up_s[0], down_s[0], c.swiglu_limit, layer.activation_dtype, dtype)
        else:
            s = layer.shared_experts
            gate_up_t = torch.cat([s.gate_proj.weight, s.up_proj.weight])
            out += expert_mlp_torch(x, gate_up_t, s.down_proj.weight, c.swiglu_limit, layer.activation_dtype, dtype)
    return out.reshape(*hidden_states.shape[:-1], c.hidden_size)
