"""Do narrow programs (one consumer, half the weight rows) even out the MXFP4 ws kernels at decode? (GPU.)

At one token DeepSeek-V4-Flash's six experts make 192 wide GEMM1 programs on 132 SMs: 60 SMs run two, 72 one.
``mxfp4.ws.narrow_grid`` picks narrow programs where the wide grid holds more than one an SM and at most two. At
1-4 tokens, the routed experts (W4A16) with narrow programs forced off and on (the same bits), GEMM1 and GEMM2 alone
(torch.profiler), and the layer at one token, with its shared expert (fp8, on the side stream) and without it;
``--activation-quant fp8``: the same for W4A8 (``mxfp4/w4a8_decode.py``, which takes the same rule). Prints one JSON
object a line.

    python -m research.mxfp4_narrow [--models deepseek-v4-flash qwen3-30b-a3b] [--tokens 1 2 3 4] [--batch-invariant]
                                    [--activation-quant fp8]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import replace
from functools import partial

import torch

from moefuse.bench import timing
from moefuse.config import preset
from moefuse.experts.mxfp4 import ws
from moefuse.layer import MoELayer, routed_experts
from research.fp8_decode_probe import kernel_us


def _us(call) -> float:  # noqa: ANN001 - a capturable closure
    return round(timing.graph_time_us([call], replays=50), 1)


def _kernels(call) -> dict:  # noqa: ANN001
    """Device µs a call of GEMM1 and GEMM2 (eager launches under torch.profiler)."""
    return {name.removesuffix("_us"): round(us, 1) for name, us in kernel_us([call], rounds=20).items()}


def _forced(on: bool, programs: int, block_m: int, device: torch.device) -> bool:
    return on and block_m in ws.NARROW_HEIGHTS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["deepseek-v4-flash", "qwen3-30b-a3b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--repeats", type=int, default=3, help="alternating off/on timings, the median kept")
    parser.add_argument("--batch-invariant", action="store_true", help="the layers batch-invariant (their router, "
                        "gate and shared expert; the routed experts' MXFP4 plans are the same either way)")
    parser.add_argument("--activation-quant", choices=["fp8"], help="W4A8 (default: W4A16)")
    args = parser.parse_args(argv)
    quant = args.activation_quant or "default"
    gen = torch.Generator("cuda").manual_seed(0)
    rule = ws.narrow_grid
    for model in args.models:
        layer = MoELayer(preset(model), device="cuda", quant="mxfp4", activation_quant=quant).init_random_(0)
        c = layer.config
        gate_up, down = layer.experts.weights()
        bare = MoELayer(replace(c, num_shared_experts=0), device="cuda", quant="mxfp4",
                        activation_quant=quant).init_random_(0)
        layer.batch_invariant = bare.batch_invariant = args.batch_invariant
        try:
            for M in args.tokens:
                x = torch.randn(M, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
                with torch.no_grad():
                    weights, ids = layer.gate(x)
                call = partial(routed_experts, x, gate_up, down, weights, ids, swiglu_limit=c.swiglu_limit,
                               activation_quant=quant)
                row: dict = {"model": model, "M": M, "batch_invariant": args.batch_invariant,
                             "activation_quant": args.activation_quant}
                times: dict = defaultdict(list)
                for _ in range(args.repeats):
                    for narrow in (False, True):
                        ws.narrow_grid = partial(_forced, narrow)
                        with torch.no_grad():
                            times[f"routed_{'narrow' if narrow else 'wide'}"].append(_us(call))
                            if M == 1:
                                times[f"layer_{'narrow' if narrow else 'wide'}"].append(_us(partial(layer, x)))
                                times[f"layer_no_shared_{'narrow' if narrow else 'wide'}"].append(
                                    _us(partial(bare, x)))
                for key, values in times.items():
                    row[key] = sorted(values)[len(values) // 2]
                for narrow in (False, True):
                    ws.narrow_grid = partial(_forced, narrow)
                    with torch.no_grad():
                        row[f"kernels_{'narrow' if narrow else 'wide'}"] = _kernels(call)
                decisions: list = []  # what the rule picks for GEMM1 and GEMM2
                ws.narrow_grid = lambda programs, block_m, device: decisions.append(rule(programs, block_m, device)) \
                    or decisions[-1]
                with torch.no_grad():
                    call()
                ws.narrow_grid = rule
                row["rule"] = decisions
                print(json.dumps(row), flush=True)
        finally:
            ws.narrow_grid = rule
        del layer, bare, gate_up, down
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
