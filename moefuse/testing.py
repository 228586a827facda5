"""Comparison helpers shared by the tests, the benchmarks and the command line.

Floats are compared by error normalised by the reference's magnitude (max and RMS), never elementwise
``allclose``: a kernel that is wrong on a few elements of a large tensor still fails, and a tolerance
means the same thing at every scale.
"""

from __future__ import annotations

from typing import Any

import torch


def rel_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``max|out - ref| / max(max|ref|, floor, tiny)`` in float64; ``inf`` when NaN/inf placement differs.
    ``floor``: the smallest scale to measure against, where the output's format rounds in absolute steps below it
    (fp16 under its smallest normal)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        raise ValueError(f"shape mismatch: {tuple(out64.shape)} vs {tuple(ref64.shape)}")
    if out64.numel() == 0:
        return 0.0
    same_nonfinite = (out64.isnan() == ref64.isnan()).all() and (
        out64[out64.isinf()].tolist() == ref64[ref64.isinf()].tolist()
        and bool((out64.isinf() == ref64.isinf()).all())
    )
    if not same_nonfinite:
        return float("inf")
    finite = ref64.isfinite()
    if not bool(finite.any()):
        return 0.0
    diff = (out64[finite] - ref64[finite]).abs().max().item()
    scale = max(ref64[finite].abs().max().item(), floor, 1e-30)
    return diff / scale


def rms_rel_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``||out - ref||_2 / max(||ref||_2, floor · sqrt(n))`` in float64 (0 when both are empty or zero);
    ``floor`` as :func:`rel_error` takes it."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    num = (out64 - ref64).norm().item()
    den = max(ref64.norm().item(), floor * ref64.numel() ** 0.5)
    return num / den if den > 0 else num


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> None:
    """Fail unless ``rel_error(out, ref) <= tol`` (NaN/inf must sit in the same places)."""
    err = rel_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def max_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two same-dtype float tensors.

    NaN must sit in the same places in both (else a huge distance); +0 and -0 are 0 apart.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"need equal dtypes and shapes, got {a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    a, b = a.detach().cpu(), b.detach().cpu()
    if not torch.equal(a.isnan(), b.isnan()):
        return 2**31
    keep = ~a.isnan()
    if not bool(keep.any()):
        return 0

    def ordered(x: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits -> a monotonic integer line
        bits = x[keep].view(_INT_VIEW[x.dtype]).long()
        magnitude = bits & (2 ** (8 * x.element_size() - 1) - 1)
        return torch.where(bits < 0, -magnitude, magnitude)

    return int((ordered(a) - ordered(b)).abs().max())


def fp32_spread(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, plan: Any,
                swiglu_limit: float | None = None, func_ulps: float = 8.0) -> torch.Tensor:
    """The RMS rounding error of fp32 experts, per output ([plan.num_rows, H], float64): what a result with no
    rounding below fp32 may err by, given how its sums cancel.

    An error model, for instances whose sums cancel so that no fixed relative tolerance holds: a sum of n terms
    t_k added one at a time errs about ``u·sqrt(n/2 · Σ t_k²)`` (u = 2^-24; each partial sum is rounded, and the
    partial sums of random terms grow as sqrt(k)); GEMM1's errors reach the output through SwiGLU's derivatives,
    SwiGLU adds ``func_ulps`` fp32 ulps of the activation of its own (exp, the division, the products), and GEMM2's
    terms err independently, so their variances add. Arguments as :func:`moefuse.experts.moe_experts_torch` takes
    them, plain weights only."""
    from moefuse.experts.reference import expert_segments

    H, I = hidden.shape[1], gate_up_proj.shape[1] // 2  # noqa: E741 (SPEC's name)
    out = torch.zeros(plan.num_rows, H, dtype=torch.float64, device=hidden.device)
    for expert, start, end, tokens in expert_segments(plan):
        x, w1, w2 = hidden[tokens].double(), gate_up_proj[expert].double(), down_proj[expert].double()
        var1 = (x * x) @ (w1 * w1).T * (H / 2)  # GEMM1's error variance, in units of u²
        gate_up = x @ w1.T
        gate, up = gate_up[:, :I], gate_up[:, I:]
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        sig = torch.sigmoid(gate)
        act = gate * sig * up
        d_gate, d_up = sig * (1 + gate * (1 - sig)) * up, gate * sig  # d act / d gate, d act / d up
        var_act = d_gate**2 * var1[:, :I] + d_up**2 * var1[:, I:] + (func_ulps * 2 * act) ** 2
        w2sq = (w2 * w2).T
        out[start:end] = (var_act @ w2sq + (I / 2) * ((act * act) @ w2sq)).sqrt() * 2.0**-24
    return out


# Tiny causal LMs of three MoE architectures (2 layers, hidden 48, 16 experts): transformers integration tests and
# the GPU integration check build the same models from here.
TINY_CONFIG: dict[str, Any] = dict(vocab_size=128, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
TINY_CAUSAL_LMS = ("deepseek-v3", "qwen3-moe", "glm4-moe")


def tiny_causal_lm(name: str, seed: int) -> torch.nn.Module:
    """A randomly initialised tiny transformers causal LM of ``name`` (one of :data:`TINY_CAUSAL_LMS`), in eval mode,
    its expert biases random (transformers initialises them to zero, which would hide them)."""
    import transformers

    # Looked up by name: the configs take more keywords (head_dim ...) than their type stubs declare.
    make = {"deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
                **{**TINY_CONFIG, "num_key_value_heads": 4}, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=0,
                q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8)),
            "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
                **TINY_CONFIG, num_experts=16, num_experts_per_tok=4, head_dim=12, norm_topk_prob=True)),
            "glm4-moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
                **TINY_CONFIG, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                first_k_dense_replace=0, head_dim=12))}
    if name not in make:
        raise ValueError(f"name must be one of {TINY_CAUSAL_LMS}, got {name!r}")
    model_name, config_name, kwargs = make[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**kwargs))
    model.eval()
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape) * 0.1)
    return model

