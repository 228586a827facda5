"""Shared-memory wavefronts of the Gluon expert kernels, counted statically from their PTX (no GPU needed).

    python -m research.smem_banks [--kernel NAME ...] [--all]   (from the repository root, TRITON_INTERPRET unset)
    python -m research.smem_banks --tl [--preset NAME ...] [--dtype bf16 fp8 ...]

Question: which shared-memory accesses of the warp-specialized kernels take more wavefronts than their bytes need
(bank conflicts), and does the address model agree with what Nsight Compute counted? Each kernel is compiled for
sm_90 as the library launches it (``scripts/sass.py``'s helpers); every ``ld.shared``/``st.shared`` (any vector
width), ``ldmatrix`` and ``stmatrix`` in its PTX has its address evaluated for the 32 lanes of a warp, by following
the address register's definitions back to ``%tid.x`` and constants (``evaluate``), and its wavefronts counted by
the bank model (``wavefronts``): 32 banks of 4 bytes; an access of w > 4 bytes a lane is served 128 bytes at a
time, 128 / w lanes a phase (``ldmatrix``/``stmatrix``: 8 lanes' 16-byte rows a matrix); within a phase a bank
serves one 4-byte word a wavefront (lanes reading the same word share it). Ideal: one wavefront a phase.

The model is static and approximate: a register defined more than once (loop-carried) takes its first definition,
the loop's first iteration, and ``%ctaid`` is 0; warp-uniform terms (the slot, the item) add multiples of the bank
period in these kernels, so a warp's pattern is still its own. Each access is reported with the source line its
PTX ``.loc`` names. ``--all`` lists every access, not only those over the ideal. ``--tl``: the ``tl`` grouped GEMMs
instead, every launch ``scripts/sass.py experts`` compiles for the presets and dtypes named (its table too).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

MASK = 0xFFFFFFFF
_DEF = re.compile(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(%\w+),\s*([^;]*);")
_ACCESS = re.compile(r"\s*(?:@!?%p\d+\s+)?(ld|st)\.shared(?:\.v(\d))?\.[bsuf](\d+)\s")
_MATRIX = re.compile(r"\s*(?:@!?%p\d+\s+)?(ldmatrix|stmatrix)\.sync\.aligned\.m8n8\.x(\d)")
_ADDRESS = re.compile(r"\[(%\w+|\w+)(?:\s*\+\s*(-?\d+))?\]")
_LOC = re.compile(r"\.loc\s+\d+\s+\d+\s+\d+\s+//\s*(\S+)")


@dataclass
class Access:
    """One shared-memory instruction of a PTX: its line, the source line it came from, what it does, its bytes
    a lane, its lanes a phase, the wavefronts the bank model counts for one warp and the ideal count."""
    line: int
    source: str
    op: str
    width: int
    wavefronts: int
    ideal: int
    addresses: list[int]


class Evaluator:
    """Integer values of a PTX's registers for one thread, from their (first) definitions."""

    def __init__(self, ptx: list[str]):
        self.defs: dict[str, tuple[str, list[str]]] = {}
        for text in ptx:
            m = _DEF.match(text)
            if m and not m.group(1).startswith(("ld.", "st.", "setp", "atom", "red", "mbarrier")):
                self.defs.setdefault(m.group(2), (m.group(1), [a.strip() for a in m.group(3).split(",")]))
        self.unresolved: set[str] = set()

    def operand(self, text: str, tid: int, depth: int) -> int:
        if text == "%tid.x":
            return tid
        if text.startswith("%"):
            return self.register(text, tid, depth + 1)
        if re.fullmatch(r"-?0[xX][0-9a-fA-F]+", text):
            return int(text, 16) & MASK
        if re.fullmatch(r"-?\d+", text):
            return int(text) & MASK
        return 0  # a symbol (the shared-memory base): every address is relative to it

    def register(self, reg: str, tid: int, depth: int = 0) -> int:
        if reg.startswith(("%ctaid", "%nctaid", "%tid.y", "%tid.z")) or depth > 200:
            return 0
        if reg not in self.defs:
            self.unresolved.add(reg)
            return 0
        op, args = self.defs[reg]
        v = [partial(self.operand, a, tid, depth) for a in args]
        base = op.split(".")[0]
        if base in ("mov", "cvt", "cvta"):
            return v[0]()
        binary: dict[str, Callable[[int, int], int]] = {
            "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
            "shl": lambda a, b: a << b, "shr": lambda a, b: a >> b, "and": lambda a, b: a & b,
            "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "min": min, "max": max}
        if base in binary and len(args) == 2:
            return binary[base](v[0](), v[1]()) & MASK
        if base == "mad":
            return (v[0]() * v[1]() + v[2]()) & MASK
        if base == "bfe":  # .s32 sign-extends the field
            width = v[2]()
            field = (v[0]() >> v[1]()) & ((1 << width) - 1)
            return (field - (1 << width)) & MASK if ".s" in op and width and field >> (width - 1) else field
        if base == "selp":
            return v[0]()  # the predicate is not evaluated: the first choice
        self.unresolved.add(f"{reg} ({op})")
        return 0


def wavefronts(addresses: list[int], width: int, lanes_per_phase: int) -> tuple[int, int]:
    """(wavefronts, ideal) of one warp's access: ``addresses[lane]`` of ``width`` bytes each, served
    ``lanes_per_phase`` lanes at a time; a bank serves one distinct 4-byte word a wavefront."""
    count = phases = 0
    for first in range(0, len(addresses), lanes_per_phase):
        words: dict[int, set[int]] = defaultdict(set)
        for address in addresses[first:first + lanes_per_phase]:
            for offset in range(0, max(width, 4), 4):
                word = (address + offset) // 4
                words[word % 32].add(word)
        count += max(len(w) for w in words.values())
        phases += 1
    return count, phases


def accesses(ptx_text: str) -> list[Access]:
    """Every shared-memory access of a PTX with its wavefronts for warp 0 (lanes 0..31)."""
    ptx = ptx_text.splitlines()
    values = Evaluator(ptx)
    found, source = [], "?"
    for number, text in enumerate(ptx, 1):
        loc = _LOC.search(text)
        if loc:
            source = loc.group(1)
            continue
        plain, matrix = _ACCESS.match(text), _MATRIX.match(text)
        address = _ADDRESS.search(text)
        if not (plain or matrix) or address is None:
            continue
        offset = int(address.group(2) or 0)
        lanes = [(values.operand(address.group(1), lane, 0) + offset) & MASK for lane in range(32)]
        if matrix:
            op, width, per_phase = matrix.group(1), 16, 8
            lanes = lanes[:8 * int(matrix.group(2))]
        else:
            assert plain is not None
            op = plain.group(1) + ".shared"
            width = int(plain.group(2) or 1) * int(plain.group(3)) // 8
            per_phase = 128 // width if width > 4 else 32
        count, ideal = wavefronts(lanes, width, per_phase)
        found.append(Access(number, source, op, width, count, ideal, lanes))
    return found


def kernels() -> dict[str, Callable[[], Any]]:
    """The Gluon expert kernels by name, each a builder of its sm_90 compile (``scripts/sass.py``)."""
    from scripts import sass

    ws, w4a8_decode = sass.experts_mxfp4_ws, sass.experts_mxfp4_w4a8_decode
    builds: dict[str, Callable[[], Any]] = {}
    for gemm in (1, 2):
        for block_m in ws.LAUNCH:
            builds[f"W4A16 GEMM{gemm} {block_m} rows"] = partial(sass.compile_mxfp4_ws_gemm, gemm, block_m, False)
        for block_m in ws.NARROW_HEIGHTS:
            builds[f"W4A16 narrow GEMM{gemm} {block_m} rows"] = partial(sass.compile_mxfp4_ws_gemm, gemm, block_m,
                                                                        False, narrow=True)
        builds[f"W4A8 GEMM{gemm} 128 rows"] = partial(sass.compile_mxfp4_w4a8_gemm, gemm, 128, False)
        for block_m in w4a8_decode.LAUNCH:
            builds[f"W4A8 decode GEMM{gemm} {block_m} rows"] = partial(sass.compile_mxfp4_w4a8_decode_gemm, gemm,
                                                                       block_m, False)
        for block_m in ws.NARROW_HEIGHTS:
            builds[f"W4A8 decode narrow GEMM{gemm} {block_m} rows"] = partial(
                sass.compile_mxfp4_w4a8_decode_gemm, gemm, block_m, False, narrow=True)
        for dtype in ("bf16", "fp8"):
            builds[f"persistent {dtype} GEMM{gemm}"] = partial(sass.compile_persistent_gemm, gemm, False, dtype)
    return builds


def report(name: str, ptx: str, every: bool) -> None:
    """One kernel's line (its accesses, those over the ideal and by how much) and, below it, those accesses (or
    ``every`` access)."""
    found = accesses(ptx)
    over = [a for a in found if a.wavefronts > a.ideal]
    excess = sum(a.wavefronts - a.ideal for a in over)
    print(f"{name}: {len(found)} shared accesses, {len(over)} over the ideal by {excess} wavefronts a warp", flush=True)
    for a in (found if every else over):
        print(f"    {a.source:28s} {a.op:13s} {a.width:2d} B  {a.wavefronts:2d} wavefronts (ideal {a.ideal})"
              f"  lanes 0-7 at {[x - a.addresses[0] for x in a.addresses[:8]]}")


def tl_kernels(presets: list[str] | None, dtypes: list[str] | None, every: bool) -> None:
    """``report`` for every ``tl`` GEMM launch ``scripts/sass.py experts`` compiles (its own table printed too)."""
    from scripts import sass

    compiled_stats = sass.compiled_stats

    def reporting(where: str, problems: list[str], build: Callable[[], Any]) -> Any:
        built: list[Any] = []
        result = compiled_stats(where, problems, lambda: built.append(build()) or built[-1])
        if built:
            report(where, built[0].asm["ptx"], every)
        return result

    sass.compiled_stats = reporting
    try:
        sass.main(["experts", *(["--preset", *presets] if presets else []), *(["--dtype", *dtypes] if dtypes else [])])
    finally:
        sass.compiled_stats = compiled_stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", nargs="+", help="substrings of the kernel names to take (default: all)")
    parser.add_argument("--all", action="store_true", help="list every access, not only those over the ideal")
    parser.add_argument("--tl", action="store_true", help="the tl grouped GEMMs of scripts/sass.py experts")
    parser.add_argument("--preset", nargs="+", help="with --tl: the presets (default: all)")
    parser.add_argument("--dtype", nargs="+", help="with --tl: the dtypes (default: sass.py's)")
    args = parser.parse_args(argv)
    if args.tl:
        tl_kernels(args.preset, args.dtype, args.all)
        return 0
    for name, build in kernels().items():
        if not args.kernel or any(part in name for part in args.kernel):
            report(name, build().asm["ptx"], args.all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
