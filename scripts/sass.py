"""Static sm_90 reports of moefuse's Triton kernels, compiled offline (no GPU needed).

    python scripts/sass.py router [--dump DIR] [--check]
    python scripts/sass.py experts [--preset NAME ...] [--dtype bf16 fp32] [--check]
    python scripts/sass.py mxfp4-ws [--check]
    python scripts/sass.py persistent [--check]

``router``: per model config and rows per program (BLOCK_M from ``launch_config`` at M = 8192, and 1): SASS
instructions (NOPs and the out-of-line slow paths after the last EXIT left out), instructions per row, SHFL and
REDUX counts, registers and stack bytes (non-zero means spills). The kernel's loops are unrolled and its only
branches skip the rare slow paths of ``div_rn``/``sqrt_rn``, so the count is close to what one program executes
(those skipped branch bodies, a few instructions each, are still in it). ``--dump DIR`` writes each config's ttgir
and SASS there. Then the router linear: the decode kernel per model width and batch, and the tensor-core prefill
kernel at each of its launches (``route.linear.MMA_LAUNCHES``, and the batch-invariant launch at the K runs each
preset's width takes; ``--check`` also fails on a spill there).

``experts``: every distinct launch of the two grouped GEMMs that a tile table or the heuristic picks for the SPEC §4
presets on sm_90 (``configs.pick`` at the tables' token buckets, for each table's GPU model and for a bare sm_90, which
takes the heuristic), compiled as ``gemm1_swiglu`` / ``gemm2`` launch them (TMA weights, PDL): shared memory, registers,
stack bytes, the HGMMA (wgmma) and HMMA (mma.sync) instructions in the SASS, and the main loop's instructions (all
threads) per weight of one K step, which is what bounds the MXFP4 kernels (an SM issues 128 per clock, half of them on
the integer pipe, and the read floor needs about 32 weights per clock per SM on an H200). MXFP4 launches that run the
warp-specialized Gluon kernels on sm_90 (``experts/mxfp4/ws.py``: every preset, whose widths are multiples of 128) are
left to ``mxfp4-ws``.

``mxfp4-ws``: those Gluon kernels at each tile height of ``mxfp4/ws.py``'s ``LAUNCH``, and the W4A8 ones of
``mxfp4/w4a8.py``'s (``W4A8``; ``W4A8w``: its row-maximum pass a word a load, where K/128 is not a multiple of 4)
and ``mxfp4/w4a8_decode.py``'s (``W4A8d``), with and without the clamp (they do not depend on the model otherwise):
the same columns, the main-loop instructions per weight counted over a consumer's loop (W4A16, W4A8d) or the
transform's (W4A8); ``--check`` also fails on a spill (their register budget is set to the edge).

``persistent``: the persistent prefill GEMMs of ``experts/persistent.py`` (Gluon; one launch shape for every model),
bf16, fp16 and fp8 block-scale, each schedule, with and without the clamp; ``--check`` also fails on a spill, on a
kernel without wgmma, and on stores of 1 or 2 bytes (the epilogue's 16-byte stores lost).

``--check`` exits with status 1 when a kernel fails to compile, needs more shared memory than a Hopper block
may have (227 KB; on a GPU that is an ``OutOfResources`` at launch), or, for the experts, when a 16-bit tile of
64 rows or more, or an fp8 launch of the batch-invariant order, is not on wgmma. The tests run it, so a tile-table
edit that would only break on a GPU fails CI.

Static counts and sizes, not GPU timings. Run with ``TRITON_INTERPRET`` unset: the kernels must be compiled.
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import triton
from triton.backends.compiler import GPUTarget

from moefuse import _runtime
from moefuse.config import PRESETS
from moefuse.experts import bf16 as experts_bf16
from moefuse.experts import configs
from moefuse.experts import persistent as experts_persistent
from moefuse.experts.fp8 import kernels as experts_fp8
from moefuse.experts.mxfp4 import kernels as experts_mxfp4
from moefuse.experts.mxfp4 import w4a8 as experts_mxfp4_w4a8
from moefuse.experts.mxfp4 import w4a8_decode as experts_mxfp4_w4a8_decode
from moefuse.experts.mxfp4 import ws as experts_mxfp4_ws
from moefuse.route import kernel as route_kernel
from moefuse.route import linear as route_linear

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SM90 = GPUTarget("cuda", 90, 32)

# name: (E, topk, fused shared, G, topk_group, scoring, bias, renormalize, scale on output)
ROUTER_CONFIGS = {
    "256 top-8 sigmoid": (256, 8, 0, 1, 1, "sigmoid", True, True, False),
    "DSV3 256 g8k4 top-8": (256, 8, 0, 8, 4, "sigmoid", True, True, True),
    "DSV3 + 1 fused shared": (256, 9, 1, 8, 4, "sigmoid", True, True, True),
    "Kimi-K2 384 top-8": (384, 8, 0, 1, 1, "sigmoid", True, True, False),
    "DSV4 256 top-6 sqrtsoftplus": (256, 6, 0, 1, 1, "sqrtsoftplus", True, True, False),
    "DSV4 384 top-6 sqrtsoftplus": (384, 6, 0, 1, 1, "sqrtsoftplus", True, True, False),
    "Qwen3 128 top-8 softmax": (128, 8, 0, 1, 1, "softmax", False, True, False),
    "512 top-8 sigmoid": (512, 8, 0, 1, 1, "sigmoid", True, True, False),
    "1024 top-32 (the kernel's limits)": (1024, 32, 1, 1, 1, "sigmoid", True, True, True),
}
ROUTER_POINTERS = {"scores_ptr": "*fp32", "bias_ptr": "*fp32", "ntnp_ptr": "*i32", "weights_ptr": "*fp32",
                   "ids_ptr": "*i32"}
ROUTER_SCALARS = {"M": "i32", "n_valid": "i32", "routed_scaling_factor": "fp32", "softcap": "fp32"}
# of contiguous experts tensors (and of the fp8 path's scales)
UNIT_STRIDES = ("stride_hk", "stride_wk", "stride_in", "stride_ik", "stride_on", "stride_sk", "stride_isg")
TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
              torch.float8_e4m3fn: "fp8", torch.uint8: "mxfp4"}  # block-scale e4m3 / MXFP4 weights, bf16 activations


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3, *,
                 sizes: tuple[str, ...] = ("N", "K"), maxnreg: Optional[int] = None):
    """``fn`` compiled for sm_90 with these argument types; pointers 16-byte aligned, as torch allocates, and, as
    Triton specializes them at a launch on the models' shapes, strides and the widths named in ``sizes`` (the GEMMs'
    N and K) multiples of 16. ``maxnreg``: a register cap, as a launch may ask."""
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, ty in signature.items()
             if ty.startswith("*") or (ty == "i32" and (name.startswith("stride_") or name in sizes))}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=SM90, options=options)


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
        "hgmma": sum(op.startswith(("HGMMA", "QGMMA")) for op in ops),  # wgmma: 16-bit and fp8 operands
        "hmma": sum(op.startswith("HMMA") for op in ops),
        "narrow_stores": sum(op.startswith(("STG.E.U8", "STG.E.U16", "STG.E.S8", "STG.E.S16")) for op in ops),
        "regs": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
    }
    return sass, stats


def main_loop_instructions(sass: str, shortest_with: str | None = None) -> int:
    """Instructions (NOPs left out) of the longest conditional backward branch's body: a GEMM's K loop. (An
    unconditional backward branch is the return from an out-of-line slow path, such as a TMA barrier's wait loop
    placed after the epilogue: its span would count the epilogue too.) ``shortest_with``: the shortest such body
    with an instruction whose name contains it instead, the innermost loop doing that work in a warp-specialized
    kernel (longer spans cross partitions, or are a persistent program's loop over its work items)."""
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    address = [int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16) for line in lines]
    spans = []
    for here, line in zip(address, lines):
        jump = re.search(r"@!?U?P\w+\s+BRA\s+(?:`?\(?\.L_x_\d+\)?|0x([0-9a-f]+))", line)
        if jump and jump.group(1) and int(jump.group(1), 16) < here:
            body = [op for a, op in zip(address, lines) if int(jump.group(1), 16) <= a <= here and " NOP" not in op]
            if shortest_with is None:
                spans.append(len(body))
            elif any(shortest_with in op for op in body):
                spans.append(-len(body))
    return abs(max(spans, default=0))


def compile_router(E, topk, shared, G, topk_group, scoring, bias, renormalize, scale_output, block_m):
    """``_fused_gate_kernel`` as ``fused_gate`` launches it on an H200 (PDL and a device ``num_token_non_padded``)."""
    constexprs = route_kernel.gate_constexprs(
        E, topk, shared, G, topk_group, scoring, has_softcap=False, has_bias=bias, renormalize=renormalize,
        scale_output=scale_output, ntnp_from_ptr=True, block_m=block_m, use_pdl=True)
    _, warps = route_kernel.launch_config(8192, E, G)
    return compile_sm90(route_kernel._fused_gate_kernel, {**ROUTER_POINTERS, **ROUTER_SCALARS}, constexprs, warps)


def router(args: argparse.Namespace) -> list[str]:
    problems = []
    print(f"{'config':34s} {'BLOCK_M':>7s} {'instr':>6s} {'/row':>6s} {'SHFL':>5s} {'REDUX':>5s} {'regs':>4s} "
          f"{'stack':>5s} {'smem':>6s}")
    for name, cfg in ROUTER_CONFIGS.items():
        E, G = cfg[0], cfg[3]
        for block_m in sorted({route_kernel.launch_config(8192, E, G)[0], 1}):
            compiled = compile_router(*cfg, block_m)
            sass, s = sass_stats(compiled.asm["cubin"])
            smem = compiled.metadata.shared
            print(f"{name:34s} {block_m:7d} {s['instr']:6d} {s['instr'] / block_m:6.0f} {s['shfl']:5d} "
                  f"{s['redux']:5d} {s['regs']:4d} {s['stack']:5d} {smem:6d}", flush=True)
            if smem > configs.HOPPER_SMEM:
                problems.append(f"router {name}, BLOCK_M {block_m}: {smem} bytes of shared memory")
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                stem = re.sub(r"\W+", "_", name) + f"_m{block_m}"
                (args.dump / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
                (args.dump / f"{stem}.sass").write_text(sass)
    print(f"\n{'router linear (bf16 x, fp32 weight)':34s} {'M':>7s} {'H':>6s} {'regs':>4s} {'stack':>5s} {'smem':>6s}")
    for H in (2048, 7168):
        # the decode launches, and the batch-invariant one over row blocks (fp16 / fp32 activations)
        for M, row_blocks in ((1, False), (route_linear.MAX_TOKENS, False), (route_linear.INVARIANT_ROWS, True)):
            block_m, block_k = route_linear.block_shape(M, H)
            compiled = compile_sm90(
                route_linear._router_logits_kernel,
                {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "H": "i32",
                 "stride_xm": "i32", "stride_we": "i32", "stride_om": "i32"},
                {"stride_xk": 1, "stride_wk": 1, "stride_oe": 1, "BLOCK_M": block_m, "BLOCK_K": block_k,
                 "ROW_BLOCKS": row_blocks},
                route_linear.NUM_WARPS)
            _, s = sass_stats(compiled.asm["cubin"])
            smem = compiled.metadata.shared
            print(f"{'':34s} {M:7d} {H:6d} {s['regs']:4d} {s['stack']:5d} {smem:6d}", flush=True)
            if smem > configs.HOPPER_SMEM:
                problems.append(f"router linear M={M} H={H}: {smem} bytes of shared memory")
    print(f"\n{'router linear, tensor cores (prefill)':34s} {'tile':>20s} {'regs':>4s} {'stack':>5s} {'smem':>6s} "
          f"{'HGMMA':>5s}")
    fn = route_linear._router_logits_mma_kernel
    # each launch the op picks, and the batch-invariant launch with K in the runs each preset's width takes
    invariant = sorted({route_linear.invariant_runs(c.hidden_size) for c in PRESETS.values()} - {1})
    launches = [(c, 1) for c in route_linear.MMA_LAUNCHES] + [(route_linear.INVARIANT_MMA, r) for r in invariant]
    for c, split_k in launches:
        constexprs = {"stride_xk": 1, "stride_oe": 1, "UPCAST": False, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n,
                      "BLOCK_K": c.block_k, "SPLIT_K": split_k}
        signature = {"x_ptr": "*bf16", "parts_ptr": "*bf16", "out_ptr": "*fp32", "M": "i32", "E": "i32", "H": "i32",
                     "stride_xm": "i32", "stride_om": "i32", **{name: "constexpr" for name in constexprs}}
        # H a multiple of 16, as every model's (and as Triton specializes it at launch): the loads pipeline
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
                 for name in ("x_ptr", "parts_ptr", "out_ptr", "E", "H", "stride_xm", "stride_om")}
        compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                                            attrs=attrs),
                                  target=SM90, options={"num_warps": c.warps, "num_stages": c.stages})
        _, st = sass_stats(compiled.asm["cubin"])
        smem = compiled.metadata.shared
        tile = f"{c.block_m}x{c.block_n}x{c.block_k}" + (f", {split_k} runs" if split_k > 1 else "")
        print(f"{'':34s} {tile:>20s} {st['regs']:4d} {st['stack']:5d} {smem:6d} {st['hgmma']:5d}", flush=True)
        if smem > configs.HOPPER_SMEM or st["stack"] or not st["hgmma"]:
            problems.append(f"router linear {tile}: {smem} bytes of shared memory, {st['stack']} of stack, "
                            f"{st['hgmma']} wgmma")
    return problems


def compile_gemm(gemm: int, dtype: torch.dtype, block_m: int, tiles: configs.GemmTiles, k: int, has_limit: bool,
                 swap: bool = False):
    """GEMM1 (``gemm=1``) or GEMM2 of reduction length ``k``, as ``gemm1_swiglu`` / ``gemm2`` launch it on sm_90
    for contiguous weights: TMA weight loads, PDL, half-tile pieces for tall tiles; ``swap``: the batch-invariant
    order's swapped product (``tiles`` as ``bf16.swapped`` gives them)."""
    fn = experts_bf16._gemm1_swiglu_kernel if gemm == 1 else experts_bf16._gemm2_kernel
    ty = TYPE_NAMES[dtype]
    joint = gemm == 1 and experts_bf16.joint_operand(block_m, tiles.block_n)
    constexprs = {
        **experts_bf16._dtype_flags(dtype),
        "EVEN_K": k % tiles.block_k == 0, "BLOCK_M": block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
        "GROUP_M": tiles.group_m, "W_TMA": True, "HALF_TILES": block_m >= experts_bf16.HALF_TILES_MIN_BLOCK_M,
        **({"W_JOINT": joint} if gemm == 1 else {}),
        "USE_PDL": True,
        # Contiguous tensors: the launcher passes these strides as 1, which Triton specialises to a constant.
        **{name: 1 for name in UNIT_STRIDES if name in fn.arg_names},
        **({"HAS_LIMIT": has_limit} if gemm == 1 else {}),
        "SWAP": swap,
    }
    index_pointers = ("tile_expert_ptr", "tile_row_start_ptr", "expert_offsets_ptr", "p2e_ptr")
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            continue
        if name in index_pointers:
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{ty}"
        elif name == "w_desc":
            box = f"2, {tiles.block_n}, {tiles.block_k}" if joint else f"{tiles.block_n}, {tiles.block_k}"
            signature[name] = f"tensordesc<{ty}[{box}]>"
        elif name == "limit":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    return compile_sm90(fn, signature, constexprs, tiles.num_warps, tiles.num_stages)


def compile_fp8_gemm(gemm: int, block_m: int, tiles: configs.GemmTiles, has_limit: bool, split_k: int = 1,
                     half_columns: int = 0, wgmma: bool = False):
    """The fp8 block-scale GEMM1 or GEMM2 (``experts/fp8/kernels.py``) as ``experts_fp8`` launches it on sm_90 (TMA
    weights, TMA activation rows: the pass's for GEMM1, GEMM1's for GEMM2; PDL); ``tiles`` adapted by ``fp8_tiles``;
    ``split_k``: GEMM1's K in that many programs; ``half_columns`` (if not 0): its gate and up tiles as programs of
    their own, each summing that many columns; ``wgmma``: GEMM1 swapped below 64 rows (the batch-invariant order)."""
    fn = experts_fp8._gemm1_fp8_kernel if gemm == 1 else experts_fp8._gemm2_fp8_kernel
    box = experts_fp8.BLOCK  # a step loads tiles.block_k // box boxes
    constexprs = {
        "EMULATE_RTNE": False, "BLOCK_M": block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": box,
        "BOXES": tiles.block_k // box, "GROUP_M": tiles.group_m, "W_TMA": True, "USE_PDL": True, "A_TMA": True,
        **{name: 1 for name in UNIT_STRIDES + ("stride_ak",) if name in fn.arg_names},
        **({"HAS_LIMIT": has_limit, "UP_ALIGNED": True, "SPLIT_K": split_k, "HALF_N": half_columns,
            "SWAP": wgmma and block_m < experts_fp8.WGMMA_MIN_ROWS} if gemm == 1
           else {"SWAP": block_m < experts_fp8.WGMMA_MIN_ROWS}),
    }
    rows = f"tensordesc<fp8e4nv[{block_m}, {box}]>"
    types = {"hidden_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*fp8e4nv", "inter_ptr": "*fp8e4nv",
             "a_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "is_ptr": "*fp32", "as_ptr": "*fp32", "part_ptr": "*fp32",
             "limit": "fp32",
             "a_desc": rows, "inter_desc": rows,
             "w_desc": f"tensordesc<fp8e4nv[{half_columns or tiles.block_n}, {box}]>"}
    signature = {name: types.get(name, "*i32" if name.endswith("_ptr") else "i32")
                 for name in fn.arg_names if name not in constexprs}
    return compile_sm90(fn, signature, constexprs, tiles.num_warps, tiles.num_stages)


def compile_mxfp4_gemm(gemm: int, block_m: int, tiles: configs.GemmTiles, has_limit: bool):
    """The MXFP4 GEMM1 or GEMM2 (``experts/mxfp4/kernels.py``) as ``experts_mxfp4`` launches it on sm_90 (bf16
    activations, TMA packed weights, PDL); ``tiles`` adapted by ``mxfp4_tiles``."""
    fn = experts_mxfp4._gemm1_mxfp4_kernel if gemm == 1 else experts_mxfp4._gemm2_mxfp4_kernel
    constexprs = {
        "EMULATE_RTNE": False, "BLOCK_M": block_m, "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k, "GROUP_M": tiles.group_m, "W_TMA": True, "USE_PDL": True,
        **{name: 1 for name in UNIT_STRIDES if name in fn.arg_names},
        **({"HAS_LIMIT": has_limit} if gemm == 1 else {}),
    }
    types = {"hidden_ptr": "*bf16", "out_ptr": "*bf16", "inter_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8",
             "limit": "fp32", "w_desc": f"tensordesc<i32[{tiles.block_n}, {tiles.block_k // 8}]>"}
    signature = {name: types.get(name, "*i32" if name.endswith("_ptr") else "i32")
                 for name in fn.arg_names if name not in constexprs}
    return compile_sm90(fn, signature, constexprs, tiles.num_warps, tiles.num_stages)


def compile_gluon(fn, types: dict[str, str], constexprs: dict[str, Any], maxnreg: int):
    """A Gluon kernel of the experts compiled for sm_90 on 4 warps (plus its partitions' own): ``types`` names
    the arguments' types where they are not an int32 pointer (``*_ptr``) or int32; pointers and the widths and
    row strides are declared 16-divisible, as the launches pass them."""
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: types.get(name, "*i32" if name.endswith("_ptr") else "i32")
                 for name in fn.arg_names if name not in constexprs}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, ty in signature.items()
             if ty.startswith("*") or name in ("N", "K", "stride_im", "stride_om", "stride_sn")}
    src = GluonASTSource(fn, {**signature, **{name: "constexpr" for name in constexprs}}, constexprs, attrs)
    return triton.compile(src, target=SM90, options={"num_warps": 4, "maxnreg": maxnreg})


def compile_mxfp4_ws_gemm(gemm: int, block_m: int, has_limit: bool, narrow: bool = False):
    """The warp-specialized MXFP4 GEMM1 or GEMM2 (``experts/mxfp4/ws.py``, Gluon) as ``experts_mxfp4_ws`` launches
    it on sm_90: two 64-row consumers (one, ``narrow``), 128-deep steps, registers and slots from ``LAUNCH``."""
    from triton.experimental.gluon import language as gl

    ws = experts_mxfp4_ws
    fn = ws._gemm1_ws_kernel if gemm == 1 else ws._gemm2_ws_kernel
    shape = ws.LAUNCH[block_m]
    constexprs = {"BLOCK_M": block_m, "STAGES": shape.stages, "WL": ws.WORD_LAYOUT,
                  "PRODUCER_REGS": ws.PRODUCER_REGS, "CONSUMER_REGS": shape.consumer_regs, "NARROW": narrow,
                  **({"HAS_LIMIT": has_limit} if gemm == 1 else {})}
    box_rows = ws.ROWS // 2 if narrow and gemm == 1 else ws.ROWS  # narrow GEMM1 loads 32 gate and 32 up rows
    w_layout = gl.NVMMASharedLayout.get_default_for([box_rows, ws.BLOCK_K // 8], gl.int32)
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, ws.BLOCK_K], gl.bfloat16)
    types = {"w_desc": f"tensordesc<i32[{box_rows}, {ws.BLOCK_K // 8}],{w_layout!r}>",
             "a_desc": f"tensordesc<bf16[{block_m}, {ws.BLOCK_K}],{a_layout!r}>",
             "s_ptr": "*i32", "inter_ptr": "*bf16", "out_ptr": "*bf16", "limit": "fp32"}
    return compile_gluon(fn, types, constexprs, shape.maxnreg)


def compile_mxfp4_w4a8_gemm(gemm: int, block_m: int, has_limit: bool, quads: bool = True):
    """The W4A8 MXFP4 GEMM1 or GEMM2 (``experts/mxfp4/w4a8.py``, Gluon) as ``experts_mxfp4_w4a8`` launches it on
    sm_90: a transform warp group, two 64-row consumers, registers and slots from ``LAUNCH``; ``quads``: the
    row-maximum pass four exponent words a load (K/128 a multiple of 4), else one."""
    from triton.experimental.gluon import language as gl

    w4a8 = experts_mxfp4_w4a8
    fn, shape = w4a8._w4a8_kernel, w4a8.LAUNCH[block_m]
    constexprs = {"GEMM1": gemm == 1, "G": w4a8.item_group(gemm == 1), "HAS_LIMIT": has_limit, "STAGES": shape.stages,
                  "PRODUCER_REGS": experts_mxfp4_ws.PRODUCER_REGS, "CONSUMER_REGS": shape.consumer_regs,
                  "QUADS": quads}
    w_box, a_box = [w4a8.BLOCK_N // 2, w4a8.BLOCK_K // 2], [block_m, w4a8.BLOCK_K]
    w_layout = gl.NVMMASharedLayout.get_default_for(w_box, gl.int8)
    a_layout = gl.NVMMASharedLayout.get_default_for(a_box, gl.float8e4nv)
    types = {"w_desc": f"tensordesc<i8[{w_box[0]}, {w_box[1]}],{w_layout!r}>",
             "a_desc": f"tensordesc<fp8e4nv[{a_box[0]}, {a_box[1]}],{a_layout!r}>",
             "s_ptr": "*i32", "as_ptr": "*fp32", "limit": "fp32",
             # GEMM1 writes the intermediate quantized (values, scales); GEMM2 passes its output twice
             "out_ptr": "*fp8e4nv" if gemm == 1 else "*bf16", "os_ptr": "*fp32" if gemm == 1 else "*bf16"}
    return compile_gluon(fn, types, constexprs, shape.maxnreg)


def compile_mxfp4_w4a8_decode_gemm(gemm: int, block_m: int, has_limit: bool, narrow: bool = False):
    """The W4A8 decode GEMM1 or GEMM2 (``experts/mxfp4/w4a8_decode.py``, Gluon) as ``experts_mxfp4_w4a8_decode``
    launches it on sm_90: ``ws.py``'s programs on packed bytes and e4m3 rows (one consumer, ``narrow``), registers
    and slots from ``LAUNCH``."""
    from triton.experimental.gluon import language as gl

    d = experts_mxfp4_w4a8_decode
    fn = d._gemm1_kernel if gemm == 1 else d._gemm2_kernel
    shape = d.LAUNCH[block_m]
    constexprs = {"BLOCK_M": block_m, "STAGES": shape.stages, "PRODUCER_REGS": experts_mxfp4_ws.PRODUCER_REGS,
                  "CONSUMER_REGS": shape.consumer_regs, "NARROW": narrow,
                  **({"HAS_LIMIT": has_limit} if gemm == 1 else {})}
    box_rows = d.ROWS // 2 if narrow and gemm == 1 else d.ROWS  # narrow GEMM1 loads 32 gate and 32 up rows
    w_box, a_box = [box_rows, d.BLOCK_K // 2], [block_m, d.BLOCK_K]
    w_layout = gl.NVMMASharedLayout.get_default_for(w_box, gl.int8)
    a_layout = gl.NVMMASharedLayout.get_default_for(a_box, gl.float8e4nv)
    types = {"w_desc": f"tensordesc<i8[{w_box[0]}, {w_box[1]}],{w_layout!r}>",
             "a_desc": f"tensordesc<fp8e4nv[{a_box[0]}, {a_box[1]}],{a_layout!r}>",
             "s_ptr": "*i32", "as_ptr": "*fp32", "inter_ptr": "*bf16", "out_ptr": "*bf16", "limit": "fp32"}
    return compile_gluon(fn, types, constexprs, shape.maxnreg)


def compile_persistent_gemm(gemm: int, has_limit: bool, dtype: str = "bf16", dynamic: bool = False):
    """The persistent warp-specialized GEMM1 or GEMM2 (``experts/persistent.py``, Gluon) as ``experts_persistent``
    (``dtype`` bf16 or fp16) or ``experts_persistent_fp8`` (``dtype`` fp8: e4m3 operands, bf16 output) launches it
    on sm_90: a producer warp, two 64-row consumers, ``STAGES`` slots; ``dynamic``: items claimed from a counter."""
    from triton.experimental.gluon import language as gl

    p = experts_persistent
    constexprs = {"GEMM1": gemm == 1, "HAS_LIMIT": has_limit, "STAGES": p.STAGES, "DYNAMIC": dynamic,
                  "PRODUCER_REGS": p.PRODUCER_REGS, "CONSUMER_REGS": p.CONSUMER_REGS}
    schedule = {"claims_ptr": "*i32", "counter_ptr": "*i32"}
    if dtype == "fp8":
        layout = gl.NVMMASharedLayout.get_default_for([p.BOX, p.FP8_BLOCK_K], gl.float8e4nv)
        types = {"a_desc": f"tensordesc<fp8e4nv[{p.BLOCK_M // 2}, {p.FP8_BLOCK_K}],{layout!r}>",
                 "w_desc": f"tensordesc<fp8e4nv[{p.BOX}, {p.FP8_BLOCK_K}],{layout!r}>",
                 "as_ptr": "*fp32", "ws_ptr": "*fp32", "limit": "fp32", **schedule,
                 # GEMM1 writes the intermediate quantized (values, scales); GEMM2 passes its output twice
                 "out_ptr": "*fp8e4nv" if gemm == 1 else "*bf16", "os_ptr": "*fp32" if gemm == 1 else "*bf16"}
        constexprs = {**{k: v for k, v in constexprs.items() if not k.endswith("_REGS")},
                      "FP8_CONSUMER_REGS": p.FP8_CONSUMER_REGS}
        return compile_gluon(p._persistent_fp8_kernel, types, constexprs, p.MAXNREG)
    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([p.BOX, p.BLOCK_K], gl_dtype)  # 128-byte rows: both boxes'
    types = {"a_desc": f"tensordesc<{dtype}[{p.BLOCK_M // 2}, {p.BLOCK_K}],{layout!r}>",
             "w_desc": f"tensordesc<{dtype}[{p.BOX}, {p.BLOCK_K}],{layout!r}>",
             "out_ptr": f"*{dtype}", "limit": "fp32", **schedule}
    return compile_gluon(p._persistent_kernel, types, constexprs, p.MAXNREG)


def compiled_stats(where: str, problems: list[str], build: Callable[[], Any]) -> Optional[tuple[str, dict, int]]:
    """``build()``'s kernel: its SASS, ``sass_stats`` and shared memory bytes, or None when it does not compile.
    A compile error, or more shared memory than a Hopper block may have, goes into ``problems``."""
    try:
        compiled = build()
    except Exception as error:  # any compiler error is a finding: reported, and --check fails
        problems.append(f"{where}: does not compile ({type(error).__name__}: {error})")
        print(problems[-1], flush=True)
        return None
    text, stats = sass_stats(compiled.asm["cubin"])
    smem = compiled.metadata.shared
    if smem > configs.HOPPER_SMEM:
        problems.append(f"{where}: {smem} bytes of shared memory (at most {configs.HOPPER_SMEM})")
    return text, stats, smem


def targets() -> list[tuple[str, configs.Arch]]:
    """What the presets' launches are picked for on sm_90: each tile table's GPU model (its table, then the heuristic
    where it has no entry), and a bare sm_90 (the heuristic alone)."""
    found: list[tuple[str, configs.Arch]] = []
    for name, path in sorted(configs.TABLES.items()):
        if path.exists():
            head = configs.load_table(path)["gpu"]
            gpu = _runtime.GPU(head["name"], tuple(head["capability"]), head["sms"], configs.HOPPER_SMEM)
            found.append((name, gpu))
    return found + [("sm_90", (9, 0))]


def _invariant_fp8_gemm1(cfg: configs.TileConfig, rows: int, width: int, sms: int) -> tuple[configs.GemmTiles, int]:
    """fp8 GEMM1's batch-invariant launch on ``rows`` plan rows, as ``experts_fp8`` makes it (K unsplit; in gate and
    up halves where its grid fills at most two programs an SM), and the columns a half sums (0: whole tiles)."""
    halves = configs.fp8_halves(rows, width, sms)
    columns = configs.fp8_half_columns(rows, width, sms) if halves else 0
    return experts_fp8.fp8_tiles(cfg.gemm1, cfg.block_m, True, 2, half_columns=columns), columns


def experts(args: argparse.Namespace) -> list[str]:
    problems = []
    buckets = sorted({int(m) for path in configs.TABLES.values() if path.exists()
                      for entry in configs.load_table(path)["entries"] for m in entry["buckets"]})
    dtypes = [dtype for dtype, ty in TYPE_NAMES.items() if ty in args.dtype]
    print(f"{'preset':18s} {'dtype':5s} {'M':>5s} {'GEMM':4s} {'BLOCK_M':>7s} {'N x K':>9s} {'group':>5s} "
          f"{'warps':>5s} {'stages':>6s} {'smem':>6s} {'regs':>4s} {'stack':>5s} {'HGMMA':>5s} {'HMMA':>5s} "
          f"{'loop/weight':>11s}")
    seen = set()
    for name, dtype, M, (target, arch) in itertools.product(args.preset, dtypes, buckets, targets()):
        c = PRESETS[name]
        fp8, mxfp4 = dtype == torch.float8_e4m3fn, dtype == torch.uint8
        cfg = configs.pick(M, c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, dtype, arch)
        gemms = [(1, cfg.gemm1, c.hidden_size), (2, cfg.gemm2, c.intermediate_size)]
        split = configs.fp8_split_k(M * c.top_k, c.intermediate_size, configs.gpu_of(arch).sms) if fp8 else 1
        launches = [(cfg.block_m, split, 0, False), (cfg.block_m, 1, 0, False)]  # GEMM1 may split K, GEMM2 never
        if fp8:
            gemms = [(g, experts_fp8.fp8_tiles(t, cfg.block_m, g == 1, 2 if g == 1 else 1,
                                               split if g == 1 else 1), k) for g, t, k in gemms]
            # the batch-invariant layer's GEMMs with the shared slot, on wgmma at every height (swapped below 64
            # rows): GEMM1 with K unsplit, in halves where its grid fills at most two programs an SM
            rows = M * (c.top_k + 1)
            inv = configs.pick(M, c.num_experts + 1, c.hidden_size, c.intermediate_size, c.top_k + 1, dtype, arch)
            sms = configs.gpu_of(arch).sms
            gemm1, columns = _invariant_fp8_gemm1(inv, rows, c.intermediate_size, sms)
            gemms += [(1, gemm1, c.hidden_size),
                      (2, experts_fp8.fp8_tiles(inv.gemm2, inv.block_m, False, 1, wgmma=True), c.intermediate_size)]
            launches += [(inv.block_m, 1, columns, True), (inv.block_m, 1, 0, True)]
            if c.num_shared_experts:  # the shared expert alone (beside MXFP4 experts), a one-expert plan of M rows
                width = c.shared_intermediate_size
                lone = configs.pick(M, 1, c.hidden_size, width, 1, dtype, arch)
                gemm1, columns = _invariant_fp8_gemm1(lone, M, width, sms)
                split = configs.fp8_split_k(M, width, sms)
                gemms += [(1, experts_fp8.fp8_tiles(lone.gemm1, lone.block_m, True, 2, split), c.hidden_size),
                          (1, gemm1, c.hidden_size),
                          (2, experts_fp8.fp8_tiles(lone.gemm2, lone.block_m, False, 1, wgmma=True), width)]
                launches += [(lone.block_m, split, 0, False), (lone.block_m, 1, columns, True),
                             (lone.block_m, 1, 0, True)]
        elif not mxfp4 and dtype != torch.float32:
            # the batch-invariant layer's GEMMs with the shared slot: the default's heights, swapped below 64 rows
            inv = configs.pick(M, c.num_experts + 1, c.hidden_size, c.intermediate_size, c.top_k + 1, dtype, arch)
            size = dtype.itemsize
            swapped = [(g, experts_bf16.swapped(inv.block_m, t, 3 - g, size), k)
                       for g, t, k in ((1, inv.gemm1, c.hidden_size), (2, inv.gemm2, c.intermediate_size))]
            gemms += [(g, t, k) for g, t, k in swapped if t is not None]
            launches += [(inv.block_m, 1, 0, True) for _, t, _ in swapped if t is not None]
        if mxfp4:
            gemms = [(g, experts_mxfp4.mxfp4_tiles(t), k) for g, t, k in gemms]
        for (gemm, tiles, k), (block_m, split_k, half_columns, wgmma) in zip(gemms, launches):
            has_limit = gemm == 1 and c.swiglu_limit is not None
            if (mxfp4 and cfg.block_m in experts_mxfp4_ws.LAUNCH  # the Gluon kernels run: `mxfp4-ws`
                    and experts_mxfp4_ws.widths_fit(c.hidden_size, c.intermediate_size)):
                continue
            key = (gemm, dtype, block_m, tiles, k % tiles.block_k == 0, has_limit, split_k, half_columns, wgmma)
            if key in seen:  # N and K are run-time arguments: the same launch compiles the same
                continue
            seen.add(key)
            halves = (f" halves of {half_columns}" if half_columns else "") + (" on wgmma" if wgmma else "")
            where = f"{name} {TYPE_NAMES[dtype]} M={M} GEMM{gemm}{halves} ({target})"
            result = compiled_stats(where, problems, lambda: (
                compile_fp8_gemm(gemm, block_m, tiles, has_limit, split_k, half_columns, wgmma) if fp8
                else compile_mxfp4_gemm(gemm, block_m, tiles, has_limit) if mxfp4
                else compile_gemm(gemm, dtype, block_m, tiles, k, has_limit, wgmma)))
            if result is None:
                continue
            text, s, smem = result
            # Main-loop instructions of all threads per weight of one K step: the unpacking cost (MXFP4).
            columns = half_columns or tiles.block_n * (1 + (gemm == 1))  # halves: one tile's
            weights = columns * tiles.block_k
            per_weight = main_loop_instructions(text) * tiles.num_warps * 32 / weights
            print(f"{name:18s} {TYPE_NAMES[dtype]:5s} {M:5d} {gemm:4d}{'h' if half_columns else ' '}{block_m:6d} "
                  f"{tiles.block_n:4d}x{tiles.block_k:<4d} {tiles.group_m:5d} {tiles.num_warps:5d} "
                  f"{tiles.num_stages:6d} {smem:6d} {s['regs']:4d} {s['stack']:5d} {s['hgmma']:5d} "
                  f"{s['hmma']:5d} {per_weight:11.2f}", flush=True)
            if dtype != torch.float32 and (block_m >= 64 or wgmma) and s["hgmma"] == 0:
                problems.append(f"{where}: a {block_m}-row tile without wgmma (HGMMA)")
    return problems


def mxfp4_ws(args: argparse.Namespace) -> list[str]:
    """The warp-specialized MXFP4 GEMMs at every tile height of their ``LAUNCH`` tables (the same for every model:
    widths are run-time arguments), with and without the SwiGLU clamp: W4A16 (``mxfp4/ws.py``) and W4A8
    (``mxfp4/w4a8.py``, ``mxfp4/w4a8_decode.py``)."""
    problems = []
    print(f"{'MMA':5s} {'GEMM':4s} {'BLOCK_M':>7s} {'clamp':>5s} {'maxnreg':>7s} {'stages':>6s} {'smem':>6s} "
          f"{'regs':>4s} {'stack':>5s} {'HGMMA':>5s} {'loop/weight':>11s}")
    launches = [("W4A16", block_m, shape.maxnreg, shape.stages, partial(compile_mxfp4_ws_gemm, narrow=False))
                for block_m, shape in experts_mxfp4_ws.LAUNCH.items()]
    launches += [("W4A16n", block_m, experts_mxfp4_ws.LAUNCH[block_m].maxnreg, experts_mxfp4_ws.LAUNCH[block_m].stages,
                  partial(compile_mxfp4_ws_gemm, narrow=True)) for block_m in experts_mxfp4_ws.NARROW_HEIGHTS]
    launches += [(mma, block_m, shape.maxnreg, shape.stages, partial(compile_mxfp4_w4a8_gemm, quads=quads))
                 for block_m, shape in experts_mxfp4_w4a8.LAUNCH.items()
                 for mma, quads in (("W4A8", True), ("W4A8w", False))]
    launches += [("W4A8d", block_m, shape.maxnreg, shape.stages, partial(compile_mxfp4_w4a8_decode_gemm, narrow=False))
                 for block_m, shape in experts_mxfp4_w4a8_decode.LAUNCH.items()]
    launches += [("W4A8dn", block_m, experts_mxfp4_w4a8_decode.LAUNCH[block_m].maxnreg,
                  experts_mxfp4_w4a8_decode.LAUNCH[block_m].stages,
                  partial(compile_mxfp4_w4a8_decode_gemm, narrow=True)) for block_m in experts_mxfp4_ws.NARROW_HEIGHTS]
    for mma, block_m, maxnreg, stages, build in launches:
        for gemm, has_limit in ((1, False), (1, True), (2, False)):
            where = f"warp-specialized MXFP4 {mma} GEMM{gemm}, BLOCK_M {block_m}, clamp {has_limit}"
            result = compiled_stats(where, problems, lambda: build(gemm, block_m, has_limit))
            if result is None:
                continue
            text, s, smem = result
            # W4A16 and W4A8's decode kernels: a consumer thread's K step, 64 rows x 128 columns of weights over
            # its warp group's 128 threads. W4A8: the transform's (the shortest loop that stores to shared memory),
            # 128 rows x 128 over 128 threads, TRANSFORM_STEPS steps an iteration.
            per_weight = (main_loop_instructions(text, shortest_with="GMMA") / 64 if mma not in ("W4A8", "W4A8w")
                          else main_loop_instructions(text, shortest_with="STS")
                          / (128 * experts_mxfp4_w4a8.TRANSFORM_STEPS))
            print(f"{mma:5s} {gemm:4d} {block_m:7d} {str(has_limit):>5s} {maxnreg:7d} {stages:6d} {smem:6d} "
                  f"{s['regs']:4d} {s['stack']:5d} {s['hgmma']:5d} {per_weight:11.2f}", flush=True)
            if s["stack"] or not s["hgmma"]:  # the register budget is tight: a spill is a bug
                problems.append(f"{where}: {s['stack']} bytes of stack, {s['hgmma']} wgmma")
    return problems


def persistent(args: argparse.Namespace) -> list[str]:
    """The persistent prefill GEMMs (``experts/persistent.py``): one launch shape for every model (widths are
    run-time arguments), bf16, fp16 and fp8 block-scale, each schedule, with and without the SwiGLU clamp (the
    dynamic schedule on GEMM1 without it and GEMM2: the clamp changes only the epilogue)."""
    problems = []
    print(f"{'dtype':5s} {'schedule':8s} {'GEMM':4s} {'clamp':>5s} {'smem':>6s} {'regs':>4s} {'stack':>5s} "
          f"{'HGMMA':>5s} {'narrow stores':>13s}")
    for dtype in ("bf16", "fp16", "fp8"):
        for gemm, has_limit, dynamic in ((1, False, False), (1, True, False), (2, False, False), (1, False, True),
                                         (2, False, True)):
            schedule = "dynamic" if dynamic else "static"
            where = f"persistent {dtype} GEMM{gemm}, {schedule}, clamp {has_limit}"
            result = compiled_stats(where, problems, lambda: compile_persistent_gemm(gemm, has_limit, dtype, dynamic))
            if result is None:
                continue
            _, s, smem = result
            print(f"{dtype:5s} {schedule:8s} {gemm:4d} {str(has_limit):>5s} {smem:6d} {s['regs']:4d} {s['stack']:5d} "
                  f"{s['hgmma']:5d} {s['narrow_stores']:13d}", flush=True)
            # narrow stores: the epilogue's 16-byte stores were lost (``persistent._store``)
            if s["stack"] or not s["hgmma"] or s["narrow_stores"]:
                problems.append(f"{where}: {s['stack']} bytes of stack, {s['hgmma']} wgmma, "
                                f"{s['narrow_stores']} stores of 1 or 2 bytes")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="kernel", required=True)
    p_router = sub.add_parser("router", help="the fused router kernel, per model config")
    p_router.add_argument("--dump", type=Path, help="write ttgir and SASS per config into this folder")
    p_experts = sub.add_parser("experts", help="the grouped GEMMs, per tile config the presets pick")
    p_experts.add_argument("--preset", nargs="+", default=sorted(PRESETS), choices=sorted(PRESETS))
    p_experts.add_argument("--dtype", nargs="+", default=["bf16", "fp32", "fp8", "mxfp4"],
                           choices=list(TYPE_NAMES.values()),
                           help="activation dtypes (fp16 compiles like bf16; the table serves both); fp8: "
                                "block-scale e4m3 weights with bf16 activations")
    p_ws = sub.add_parser("mxfp4-ws", help="the warp-specialized MXFP4 GEMMs (Gluon), per tile height")
    p_persistent = sub.add_parser("persistent", help="the persistent prefill GEMMs (Gluon), bf16, fp16 and fp8")
    for p in (p_router, p_experts, p_ws, p_persistent):
        p.add_argument("--check", action="store_true", help="exit 1 on a kernel that would fail on an H200")
    args = parser.parse_args(argv)
    if _runtime.interpreting():
        parser.error("TRITON_INTERPRET is set: the kernels must be compiled, not interpreted")
    # Counts differ between compiler versions (Triton 3.9's MXFP4 consumer loops are 3.5-4.9% longer than 3.6's)
    print(f"sm_90, Triton {triton.__version__}")
    problems = {"router": router, "experts": experts, "mxfp4-ws": mxfp4_ws, "persistent": persistent}[args.kernel](
        args)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
