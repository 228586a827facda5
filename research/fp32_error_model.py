"""How far fp32 experts err from float64 where their sums cancel, against ``moefuse.testing.fp32_spread`` (CPU).

Emulates the GPU's fp32 expert arithmetic for one token on one expert: both GEMMs add their terms one fused
multiply-add at a time along K (as Triton's ieee ``tl.dot`` runs on sm_90 with fp32 operands), SwiGLU as
``gate · 1/(1 + exp(-gate)) · up`` with the exp and the division each off by up to ``--ulps`` fp32 ulps at random
(the GPU's ``ex2.approx`` and ``div.full`` are approximate), on inputs drawn as ``tests/test_fuzz.py`` draws them
(gate and up ~ N(0, 4)). Per shape H x I, over ``--draws`` seeds: the largest error over its predicted RMS
(``fp32_spread``), how often the previous allowance (8 times what torch's fp32 oracle errs on the instance) failed,
and, as a check that the bound still catches a rounding below fp32, how often the same arithmetic with the
intermediate rounded to fp16 errs past both ``--spreads`` predicted RMS errors and 1e-5 of the output (the fuzz's
rule), with the median of its error over the prediction. ``--kernel`` measures ``moe_experts`` itself instead of
the emulation (on the GPU where there is one, else through the interpreter; the fp16 column then keeps the
emulation's): what tests the model on the hardware.

    python -m research.fp32_error_model [--draws 60] [--ulps 8] [--spreads 16] [--kernel] [--shapes 1x1919,...]
"""

from __future__ import annotations

import argparse
import math

import torch

from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts
from moefuse.experts.reference import moe_experts_torch
from moefuse.testing import fp32_spread

SHAPES = ((1, 1), (2, 3), (1, 13), (7, 13), (1, 1919), (1, 3072), (3072, 1), (3072, 128), (128, 3072), (1024, 1024))


def fma_dot(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w @ a`` in fp32 as one fused multiply-add a term, in K order: products of fp32 values are exact in
    float64, so each step is the float64 sum rounded once to fp32."""
    acc = torch.zeros(w.shape[0], dtype=torch.float32)
    a64, w64 = a.double(), w.double()
    for k in range(a.shape[0]):
        acc = (acc.double() + a64[k] * w64[:, k]).float()
    return acc


def perturb(x: torch.Tensor, ulps: float, gen: torch.Generator) -> torch.Tensor:
    """``x`` times (1 + r), r uniform within ``ulps`` fp32 ulps (2^-23 each), rounded to fp32."""
    r = (torch.rand(x.shape, generator=gen, dtype=torch.float64) * 2 - 1) * ulps * 2.0**-23
    return (x.double() * (1 + r)).float()


def emulate(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ulps: float, gen: torch.Generator,
            half: bool = False) -> torch.Tensor:
    """One token's output ([H] fp32) through one expert, the GPU's order and approximations as emulated."""
    I = w1.shape[0] // 2  # noqa: E741 (SPEC's name)
    gate_up = fma_dot(x, w1)
    gate, up = gate_up[:I], gate_up[I:]
    arg = (-gate * math.log2(math.e)).float()  # exp(-g) as 2^(-g·log2 e), the argument rounded to fp32
    sig = perturb((1.0 / (1 + perturb(torch.exp2(arg.double()).float(), ulps, gen)).double()).float(), ulps, gen)
    act = ((gate * sig).float() * up).float()
    return fma_dot(act.half().float() if half else act, w2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=60)
    p.add_argument("--ulps", type=float, default=8.0, help="error of SwiGLU's exp and of its division, each")
    p.add_argument("--spreads", type=float, default=16.0, help="the fuzz's allowance, in predicted RMS errors")
    p.add_argument("--kernel", action="store_true", help="measure moe_experts, not the emulation")
    p.add_argument("--shapes", default=",".join(f"{h}x{i}" for h, i in SHAPES), help="H x I pairs")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in pair.split("x")) for pair in args.shapes.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"{'moe_experts on ' + device.type if args.kernel else 'emulation'}, {args.draws} draws a shape")
    print(f"{'H x I':>12} | err/spread median | max | old rule failed | fp16 intermediate: caught | median err/spread")
    # one token on one expert: the plans (the reference's, and the kernel's on the device) serve every shape
    plan = moe_dispatch(torch.zeros(1, 1, dtype=torch.int32), 1, 16, backend="reference")
    on = moe_dispatch(torch.zeros(1, 1, dtype=torch.int32, device=device), 1, 16, backend="triton") if args.kernel \
        else None
    for H, I in shapes:  # noqa: E741
        ratios, old_fails, half_ratios, caught = [], 0, [], 0
        for seed in range(args.draws):
            gen = torch.Generator().manual_seed(seed)
            w1 = torch.randn(1, 2 * I, H, generator=gen) * (2 / math.sqrt(H))
            w2 = torch.randn(1, H, I, generator=gen) / math.sqrt(I)
            x = torch.randn(1, H, generator=gen)
            ref = moe_experts_torch(x, w1, w2, plan, dtype=torch.float64,
                                    out=torch.zeros(1, H, dtype=torch.float64))[0]
            ref32 = moe_experts_torch(x, w1, w2, plan, dtype=torch.float32)[0]
            spread = fp32_spread(x, w1, w2, plan)[0]
            if on is not None:
                got = moe_experts(x.to(device), w1.to(device), w2.to(device), on, backend="triton")[0].cpu()
            else:
                got = emulate(x[0], w1[0], w2[0], args.ulps, gen)
            err = (got.double() - ref).abs()
            ratios.append((err / spread).max().item())
            allowed = max(1e-5 * ref.abs().max().item(), 8 * (ref32.double() - ref).abs().max().item())
            old_fails += err.max().item() > allowed
            bad = (emulate(x[0], w1[0], w2[0], args.ulps, gen, half=True).double() - ref).abs()
            half_ratios.append((bad / spread).max().item())
            caught += bool((bad > torch.maximum(args.spreads * spread, 1e-5 * ref.abs().max())).any())
        r = torch.tensor(ratios)
        print(f"{H:>5} x {I:<5} | {r.median():17.2f} | {r.max():4.1f} | {old_fails:>6} of {args.draws:<5} | "
              f"{caught:>6} of {args.draws:<5} | {torch.tensor(half_ratios).median():.0f}")


if __name__ == "__main__":
    main()
