"""Where does W4A8 lose to W4A16, kernel by kernel? (GPU.)

DeepSeek-V4-Flash's routed experts (dispatch, both GEMMs, combine) with ``activation_quant="fp8"`` and without, on
one random routing a token count: each kernel's device time per call under ``torch.profiler`` (CUDA activity, the
mean of ``--calls`` eager calls after five warm-ups) and its launches per call. Kernels of one name are added
(W4A8's two quantization passes are one ``_quantize_rows_kernel`` line, two launches).

    python -m research.w4a8_kernels [--tokens 1 1024 4096] [--calls 20] [--formats W4A8 W4A16 fp8] [--ncu]

``fp8``: the same model's routed experts with fp8 block-scale weights (``quant="fp8"``): at 128-row tiles the same
e4m3 MMA work as W4A8's kernels, with no unpacking. ``--ncu``: three plain calls of each format (no profiler), for
Nsight Compute, one format a run; at 4,096 tokens, GEMM1 then GEMM2 a call, so the third call's GEMMs are
``ncu -k regex:'_w4a8_kernel|_persistent_fp8_kernel' --launch-skip 4 --launch-count 2``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

from moefuse.config import preset
from moefuse.formats import Quant
from moefuse.layer import ActivationQuant, MoELayer, routed_experts

# --formats: each name's weight format (the layer's ``quant``) and its activations (``activation_quant``)
FORMATS: dict[str, tuple[Quant, ActivationQuant]] = {"W4A8": ("mxfp4", "fp8"), "W4A16": ("mxfp4", None),
                                                   "fp8": ("fp8", "default")}


def kernel_times(call, calls: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (µs per call, launches per call)} of ``calls`` calls of ``call``."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.key][0] += event.self_device_time_total / calls
            times[event.key][1] += event.count / calls
    return {name: (us, n) for name, (us, n) in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 1024, 4096])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--formats", nargs="+", default=["W4A8", "W4A16"], choices=list(FORMATS))
    parser.add_argument("--ncu", action="store_true", help="three plain calls a format, no profiler (docstring)")
    args = parser.parse_args(argv)
    layers = {quant: MoELayer(preset("deepseek-v4-flash"), device="cuda", quant=quant).init_random_(0)
              for quant in {FORMATS[name][0] for name in args.formats}}
    c = next(iter(layers.values())).config
    gen = torch.Generator("cuda").manual_seed(0)
    for M in args.tokens:
        x = torch.randn(M, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        with torch.no_grad():
            weights, ids = next(iter(layers.values())).gate(x)  # one routing for every format
            for name in args.formats:
                quant, activation_quant = FORMATS[name]
                gate_up, down = layers[quant].experts.weights()
                call = partial(routed_experts, x, gate_up, down, weights, ids, swiglu_limit=c.swiglu_limit,
                               activation_quant=activation_quant)
                if args.ncu:
                    for _ in range(3):
                        call()
                    torch.cuda.synchronize()
                    continue
                times = kernel_times(call, args.calls)
                print(f"{M} tokens, {name}: {sum(us for us, _ in times.values()):.1f} µs", flush=True)
                for kernel, (us, n) in sorted(times.items(), key=lambda item: -item[1][0]):
                    print(f"  {us:9.1f} µs  {n:3.0f}x  {kernel}")


if __name__ == "__main__":
    main()
