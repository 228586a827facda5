"""Where an eager op's host time goes: each public op on DeepSeek-V3 one-token inputs, with its pieces timed.

Wraps the pieces (validation, tile choice, allocation, TMA descriptors, Triton's argument binding and cache key,
the C launcher, the tensor-map encoding) with timers, calls each op many times after a synchronise, and prints the
mean host µs per call of the op and of each piece (pieces nest: a launch contains its binding and launcher).

    python scripts/host_profile.py        (on a GPU)
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import moefuse.dispatch.op as dispatch_op
import moefuse.experts.bf16 as experts_bf16
import moefuse.experts.op as experts_op
import moefuse.finalize.op as finalize_op
import moefuse.route.op as route_op
from moefuse.bench.report import format_table
from moefuse.config import preset
from moefuse.experts import configs
from moefuse.layer import MoELayer

TOTALS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - start
            COUNTS[name] += 1
    return wrapper


def instrument() -> None:
    import triton.backends.nvidia.driver as nv
    import triton.runtime.jit as jit

    for module, name in ((experts_op, "_validate"), (route_op, "_validate"), (route_op, "_validate_logits"),
                         (dispatch_op, "_validate"), (finalize_op, "_validate"), (experts_bf16, "weight_descriptor"),
                         (jit, "compute_cache_key"), (nv, "make_tensordesc_arg")):
        label = f"{module.__name__.removeprefix('moefuse.').removeprefix('triton.')}.{name}"
        setattr(module, name, timed(label, getattr(module, name)))
    experts_op.configs.pick = timed("configs.pick", configs.pick)
    original_run = jit.JITFunction.run
    jit.JITFunction.run = lambda self, *a, **k: timed("triton JITFunction.run (whole launch)", original_run)(
        self, *a, **k)
    torch_empty = torch.empty
    torch.empty = timed("torch.empty", torch_empty)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    from moefuse.dispatch import moe_dispatch
    from moefuse.experts import moe_experts, pick_block_m
    from moefuse.finalize import moe_finalize_fuse_shared
    from moefuse.route import moe_fused_gate, router_logits

    layer = MoELayer(preset("deepseek-v3"), dtype=torch.bfloat16, device="cuda").init_random_(0)
    c = layer.config
    x = torch.randn(1, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = router_logits(x, layer.gate.weight)
    bias = layer.gate.e_score_correction_bias
    kw = dict(renormalize=True, routed_scaling_factor=c.routed_scaling_factor,
              apply_routed_scaling_factor_on_output=True, num_expert_group=c.num_expert_group,
              topk_group=c.topk_group)
    weights, ids = moe_fused_gate(logits, bias, c.top_k, c.scoring_func, **kw)
    block_m = pick_block_m(1, c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, x.dtype)
    plan = moe_dispatch(ids, c.num_experts, block_m)
    w1, w2 = layer.experts.gate_up_proj, layer.experts.down_proj
    out = moe_experts(x, w1, w2, plan)
    calls = {
        "router_logits": lambda: router_logits(x, layer.gate.weight),
        "moe_fused_gate": lambda: moe_fused_gate(logits, bias, c.top_k, c.scoring_func, **kw),
        "moe_dispatch": lambda: moe_dispatch(ids, c.num_experts, block_m),
        "moe_experts": lambda: moe_experts(x, w1, w2, plan),
        "moe_finalize_fuse_shared": lambda: moe_finalize_fuse_shared(out, plan.expanded_to_permuted, weights, x,
                                                                      c.top_k),
    }
    for fn in calls.values():
        fn()
    instrument()
    rows = []
    for op, fn in calls.items():
        TOTALS.clear()
        COUNTS.clear()
        n, total = 200, 0.0
        for _ in range(n):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        rows.append({"op": op, "piece": "(whole op)", "us": total / n * 1e6, "per_op": 1})
        for piece, seconds in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
            rows.append({"op": op, "piece": piece, "us": seconds / n * 1e6, "per_op": COUNTS[piece] / n})
    print(format_table(rows, [("op", "op"), ("piece", "piece"), ("us", "host µs per op call"),
                              ("per_op", "calls per op")], "Host time of each op's pieces (DeepSeek-V3, M = 1)"))


if __name__ == "__main__":
    main()
