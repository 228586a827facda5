"""The fp8 decode probes' kernels compiled offline for sm_90 (no GPU needed), with ``scripts/sass.py``'s helpers.

    python -m research.sass_decode [--check]          (from the repository root, TRITON_INTERPRET unset)

Every build of the one-launch kernel over both GEMMs that ``fp8_decode_probe --fused`` times (``fused_decode.py``:
warps and register cap, GEMM1's arithmetic, the next item's prefetch; 16-row tiles, 3 stages) with its shared
memory, registers, stack bytes and GEMM1's loop per step; the warp-specialized one (``ws_decode.py``, Gluon) at each
of ``fp8_decode_probe --ws``'s launches, with and without the clamp, checked to fit as many programs an SM as the
launch puts there; then the L2 prefetch kernel (``l2_prefetch.py``) with either eviction hint. ``--check`` exits
with status 1 on a kernel that would fail on an H200 (``research/tests/test_sm90_decode.py`` runs it).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from moefuse import _runtime
from moefuse.experts import configs
from moefuse.experts.fp8 import kernels as experts_fp8
from research import fp8_decode_probe as probe
from research import fused_decode, l2_prefetch, ws_decode
from scripts.sass import compile_gluon, compile_sm90, compiled_stats, main_loop_instructions


def compile_fused_decode(split: int, num_warps: int, num_stages: int, maxnreg: Optional[int], prequant: bool,
                         swap1: bool, prefetch: bool, block_m: int = 16):
    """The one-launch fp8 decode kernel (``fused_decode.py``) as ``fused_experts_fp8`` launches it
    on sm_90 for the presets' widths (multiples of 128): TMA weight boxes of 128 x 128, bf16 activations and output,
    GEMM2 on 128 output columns an item."""
    fn = fused_decode._fused_decode_kernel
    constexprs = {"HAS_LIMIT": False, "EMULATE_RTNE": False, "OUT_RTNE": False, "BLOCK_M": block_m, "BLOCK_N2": 128,
                  "SPLIT": split, "SWAP": block_m < experts_fp8.WGMMA_MIN_ROWS, "PREQUANT": prequant,
                  "SWAP1": swap1, "PREFETCH": prefetch, "USE_PDL": True, "COMPILED": True,
                  **{name: 1 for name in ("stride_hk", "stride_s1k", "stride_s2k", "stride_on")}}
    box = "tensordesc<fp8e4nv[128, 128]>"
    types = {"hidden_ptr": "*bf16", "out_ptr": "*bf16", "inter_ptr": "*fp8e4nv", "aq_ptr": "*fp8e4nv",
             "w1_ptr": "*fp8e4nv", "w2_ptr": "*fp8e4nv",
             "w1s_ptr": "*fp32", "w2s_ptr": "*fp32", "is_ptr": "*fp32", "as_ptr": "*fp32", "part_ptr": "*fp32",
             "limit": "fp32", "w1_desc": box, "w2_desc": box}
    signature = {name: types.get(name, "*i32" if name.endswith("_ptr") else "i32")
                 for name in fn.arg_names if name not in constexprs}
    return compile_sm90(fn, signature, constexprs, num_warps, num_stages, sizes=("I", "H"), maxnreg=maxnreg)


def compile_ws_decode(block_m: int, stages: int, has_limit: bool, maxnreg: int):
    """The warp-specialized fp8 decode kernel (``ws_decode.py``, Gluon) as ``ws_experts_fp8``
    launches it on sm_90: a consumer warp group and a producer warp, 128 x 128 e4m3 weight boxes, bf16 activations
    and output, ``maxnreg`` registers a thread at launch."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for([ws_decode.BOX, ws_decode.BOX], gl.float8e4nv)
    box = f"tensordesc<fp8e4nv[{ws_decode.BOX}, {ws_decode.BOX}],{layout!r}>"
    types = {"w1_desc": box, "w2_desc": box, "hidden_ptr": "*bf16", "out_ptr": "*bf16", "inter_ptr": "*fp8e4nv",
             "w1s_ptr": "*fp32", "w2s_ptr": "*fp32", "is_ptr": "*fp32", "part_ptr": "*fp32", "limit": "fp32"}
    constexprs = {"HAS_LIMIT": has_limit, "BLOCK_M": block_m, "STAGES": stages, "CLAIMS": 2 * stages,
                  "PRODUCER_REGS": ws_decode.PRODUCER_REGS}
    return compile_gluon(ws_decode._ws_decode_kernel, types, constexprs, maxnreg)


def report() -> list[str]:
    """The fused decode kernel's builds that ``fp8_decode_probe --fused`` times, at the most stages it takes
    (the most shared memory): per (warps, register cap), GEMM1's arithmetic (where the activations are quantized,
    mma.sync or swapped wgmma) and whether the next item's lines are prefetched; at 14 runs of GEMM1's K (the run
    count changes only integer arithmetic). Then ``l2_prefetch.py``'s kernel, with either eviction hint."""
    problems = []
    print(f"{'warps':>5s} {'maxnreg':>7s} {'prequant':>8s} {'swap1':>5s} {'prefetch':>8s} {'stages':>6s} "
          f"{'smem':>6s} {'regs':>4s} {'stack':>5s} {'HMMA':>5s} {'HGMMA':>5s} {'GEMM1 step':>10s}")
    stages = max(probe.FUSED_STAGES)
    for warps, maxnreg in probe.FUSED_BUILDS:
        for prequant, swap1 in probe.FUSED_GEMM1:
            for prefetch in probe.FUSED_PREFETCH:
                where = (f"fused decode, {warps} warps, maxnreg {maxnreg}, prequant {prequant}, swap1 {swap1}, "
                         f"prefetch {prefetch}")
                result = compiled_stats(where, problems, lambda: compile_fused_decode(
                    14, warps, stages, maxnreg, prequant, swap1, prefetch))
                if result is None:
                    continue
                text, s, smem = result
                # GEMM1's loop: the shortest backward branch's body with its MMA in it (mma.sync, or wgmma), a warp's
                step = main_loop_instructions(text, shortest_with="GMMA" if swap1 else "HMMA")
                print(f"{warps:5d} {str(maxnreg):>7s} {str(prequant):>8s} {str(swap1):>5s} {str(prefetch):>8s} "
                      f"{stages:6d} {smem:6d} {s['regs']:4d} {s['stack']:5d} {s['hmma']:5d} {s['hgmma']:5d} "
                      f"{step:10d}", flush=True)
    print(f"\n{'tile rows':>9s} {'slots':>5s} {'maxnreg':>7s} {'programs/SM':>11s} {'clamp':>5s} {'smem':>6s} "
          f"{'stack':>5s} {'HGMMA':>5s} {'GEMM2 step':>10s}")
    block_m = ws_decode.BLOCK_M  # the only tile height it takes
    for per_sm, stages, maxnreg in probe.WS_LAUNCHES:
        for has_limit in (False, True):
            where = (f"warp-specialized decode, {block_m}-row tiles, {stages} slots, maxnreg {maxnreg}, "
                     f"clamp {has_limit}")
            result = compiled_stats(where, problems, lambda: compile_ws_decode(block_m, stages, has_limit, maxnreg))
            if result is None:
                continue
            text, s, smem = result
            # the consumer's shortest loop with a wgmma: GEMM2's step (GEMM1's holds the quantization too)
            step = main_loop_instructions(text, shortest_with="GMMA")
            print(f"{block_m:9d} {stages:5d} {maxnreg:7d} {per_sm:11d} {str(has_limit):>5s} {smem:6d} "
                  f"{s['stack']:5d} {s['hgmma']:5d} {step:10d}", flush=True)
            # the launch's programs an SM must fit: shared memory, and registers (8 warps a CTA) in 64K
            if s["stack"] or per_sm * smem > configs.HOPPER_SMEM or per_sm * 256 * maxnreg > 65536:
                problems.append(f"{where}: {s['stack']} bytes of stack, {smem} bytes of shared memory, "
                                f"{per_sm} programs an SM")
    for evict_last in (False, True):
        where = f"L2 prefetch kernel, evict_last {evict_last}"
        fn = l2_prefetch._l2_prefetch_kernel
        if compiled_stats(where, problems, lambda: compile_sm90(
                fn, {"ptr": "*u8", "nbytes": "i64"}, {"LINES": 512, "EVICT_LAST": evict_last}, 4)) is not None:
            print(f"{where}: compiles", flush=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on a kernel that would fail on an H200")
    args = parser.parse_args(argv)
    if _runtime.interpreting():
        parser.error("TRITON_INTERPRET is set: the kernels must be compiled, not interpreted")
    problems = report()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
