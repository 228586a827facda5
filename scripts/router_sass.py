"""Static sm_90 SASS size of the router kernel, compiled offline (no GPU needed).

    python scripts/router_sass.py [--dump DIR]

Prints, per model config and rows per program (BLOCK_M from ``launch_config`` at M = 8192, and 1): SASS
instructions (NOPs and the out-of-line slow paths after the last EXIT left out), instructions per row, SHFL and
REDUX counts, registers and stack bytes (non-zero means spills). The kernel's loops are unrolled and its only
branches skip the rare slow paths of ``div_rn``/``sqrt_rn``, so the count is close to what one program executes
(those skipped branch bodies, a few instructions each, are still in it). Static counts, not GPU timings.
``--dump DIR`` writes each config's ttgir and SASS there.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefuse.route import kernel  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

# name: (E, topk, fused shared, G, topk_group, scoring, bias, renormalize, scale on output)
CONFIGS = {
    "256 top-8 sigmoid": (256, 8, 0, 1, 1, "sigmoid", True, True, False),
    "DSV3 256 g8k4 top-8": (256, 8, 0, 8, 4, "sigmoid", True, True, True),
    "DSV3 + 1 fused shared": (256, 9, 1, 8, 4, "sigmoid", True, True, True),
    "Kimi-K2 384 top-8": (384, 8, 0, 1, 1, "sigmoid", True, True, False),
    "DSV4 256 top-6 sqrtsoftplus": (256, 6, 0, 1, 1, "sqrtsoftplus", True, True, False),
    "DSV4 384 top-6 sqrtsoftplus": (384, 6, 0, 1, 1, "sqrtsoftplus", True, True, False),
    "Qwen3 128 top-8 softmax": (128, 8, 0, 1, 1, "softmax", False, True, False),
    "512 top-8 sigmoid": (512, 8, 0, 1, 1, "sigmoid", True, True, False),
}
POINTERS = {"scores_ptr": "*fp32", "bias_ptr": "*fp32", "ntnp_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32"}
SCALARS = {"M": "i32", "n_valid": "i32", "routed_scaling_factor": "fp32", "softcap": "fp32"}


def compile_router(E, topk, shared, G, topk_group, scoring, bias, renormalize, scale_output, block_m):
    """Compile ``_fused_gate_kernel`` for sm_90 as ``fused_gate`` would launch it on an H200 (PDL on)."""
    constexprs = kernel.gate_constexprs(
        E, topk, shared, G, topk_group, scoring, has_softcap=False, has_bias=bias, renormalize=renormalize,
        scale_output=scale_output, ntnp_from_ptr=True, block_m=block_m, use_pdl=True)
    signature = {**POINTERS, **SCALARS, **{k: "constexpr" for k in constexprs}}
    arg_names = kernel._fused_gate_kernel.arg_names
    attrs = {(arg_names.index(p),): [["tt.divisibility", 16]] for p in POINTERS}  # torch allocations
    src = triton.compiler.ASTSource(fn=kernel._fused_gate_kernel, signature=signature, constexprs=constexprs,
                                    attrs=attrs)
    _, warps = kernel.launch_config(8192, E, G)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def sass_stats(cubin: bytes) -> tuple[str, dict]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.check_output([str(CUOBJDUMP), "-sass", f.name], text=True)
        res = subprocess.check_output([str(CUOBJDUMP), "-res-usage", f.name], text=True)
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    ops = [op for op in ops if op != "NOP"]
    ops = ops[: len(ops) - ops[::-1].index("EXIT")]  # after the last EXIT: out-of-line slow paths (div_rn, sqrt_rn)
    stats = {
        "instr": len(ops),
        "shfl": sum(op.startswith("SHFL") for op in ops),
        "redux": sum(op.startswith("REDUX") for op in ops),
        "regs": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
    }
    return sass, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", type=Path, help="write ttgir and SASS per config into this folder")
    args = parser.parse_args()
    print(f"{'config':30s} {'BLOCK_M':>7s} {'instr':>6s} {'/row':>6s} {'SHFL':>5s} {'REDUX':>5s} {'regs':>4s} "
          f"{'stack':>5s}")
    for name, cfg in CONFIGS.items():
        E, G = cfg[0], cfg[3]
        for block_m in sorted({kernel.launch_config(8192, E, G)[0], 1}):
            compiled = compile_router(*cfg, block_m)
            sass, s = sass_stats(compiled.asm["cubin"])
            print(f"{name:30s} {block_m:7d} {s['instr']:6d} {s['instr'] / block_m:6.0f} {s['shfl']:5d} {s['redux']:5d} "
                  f"{s['regs']:4d} {s['stack']:5d}", flush=True)
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                stem = re.sub(r"\W+", "_", name) + f"_m{block_m}"
                (args.dump / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
                (args.dump / f"{stem}.sass").write_text(sass)


if __name__ == "__main__":
    main()
