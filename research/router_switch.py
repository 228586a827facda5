"""Where should the router linear leave cuBLAS for the tensor-core kernel? (GPU.)

Between ``linear.MAX_TOKENS`` and ``linear.MMA_MIN_TOKENS`` tokens the router linear is cuBLAS's fp32 GEMM on an
upcast copy of ``x``; from ``MMA_MIN_TOKENS`` it is ``linear.router_logits_mma`` (the weight's exact three-part split
on the tensor cores, the split made per call). Where the second is already faster below the switch, the layer's
time drops at the switch (a cliff in ``moefuse bench sweep``). For each preset's router (H, E) and M on a grid,
both ways under CUDA-graph replay, and the switch each preset would take: the smallest M on the grid from which the
tensor-core kernel is never slower. Prints one JSON object a line; the last line the switch for all presets.

    python -m research.router_switch [--tokens 256 384 ...]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from moefuse.bench import timing
from moefuse.config import preset
from moefuse.route import linear, reference

MODELS = ("deepseek-v3", "kimi-k2", "deepseek-v4-flash", "glm-4.5-air", "qwen3-30b-a3b")
TOKENS = (128, 256, 384, 512, 640, 768, 896, 992, 1024, 1536)


def _us(call) -> float:  # noqa: ANN001 - a capturable closure
    return round(timing.graph_time_us([call], replays=30), 1)


def switch_for(times: dict[int, tuple[float, float]]) -> int:
    """The smallest M of ``times`` (M -> (cuBLAS µs, tensor-core µs)) from which the tensor cores are never slower."""
    grid = sorted(times)
    for i, M in enumerate(grid):
        if all(times[m][1] <= times[m][0] for m in grid[i:]):
            return M
    return grid[-1] * 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parser.parse_args(argv)
    gen = torch.Generator("cuda").manual_seed(0)
    switches = {}
    for model in MODELS:
        c = preset(model)
        weight = torch.randn(c.num_experts, c.hidden_size, device="cuda", generator=gen) * 0.02
        times = {}
        for M in args.tokens:
            x = torch.randn(M, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(M, c.num_experts, device="cuda")
            cublas = _us(partial(reference.router_logits_torch, x, weight, out))
            mma = _us(partial(linear.router_logits_mma, x, weight, out))
            times[M] = (cublas, mma)
            print(json.dumps({"model": model, "H": c.hidden_size, "E": c.num_experts, "M": M, "cublas_us": cublas,
                              "mma_us": mma, "mma_launch": linear.mma_launch(M, c.num_experts,
                                                                             linear._sms(x.device))._asdict()}),
                  flush=True)
        switches[model] = switch_for(times)
    print(json.dumps({"switch": switches, "all": max(switches.values())}), flush=True)


if __name__ == "__main__":
    main()
