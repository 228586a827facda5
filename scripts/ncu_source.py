"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source-level sampling.

    ncu -k regex:KERNEL --section SourceCounters -o REPORT python3 ...
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > source.csv
    python scripts/ncu_source.py source.csv [--top 20] [--at INDEX ...]

Prints the instructions holding the most warp-stall samples: their share of all samples, how many times a warp
executed them, and their largest stall reasons. ``--at``: the instructions around these indices instead, with
the same columns. A share on an instruction executed once per warp is warps parked there, not work (the idle
warps of a 1-warp producer's warp group made the persistent bf16 GEMM2's "barrier stalls", docs/PERF-NOTES.md,
2026-12-04).
"""
from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass(frozen=True)
class Instruction:
    index: int
    source: str
    samples: float
    executed: float
    stalls: dict[str, float]  # reason -> samples ("stall_barrier" ...; the "(Not Issued)" copies left out)


def _number(text: str) -> float:
    text = text.replace(",", "").strip()
    return float(text) if text else 0.0


def read(path: Path) -> list[Instruction]:
    """The instructions of an ``ncu --page source --csv --print-source sass`` export, in address order."""
    with path.open(newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    start = next((i for i, row in enumerate(rows) if "Source" in row and SAMPLES in row), None)
    if start is None:
        raise ValueError(f"{path}: no header with 'Source' and '{SAMPLES}' (an ncu --page source --csv export?)")
    head = rows[start]
    source, samples, executed = head.index("Source"), head.index(SAMPLES), head.index(EXECUTED)
    reasons = [(i, name) for i, name in enumerate(head) if name.startswith("stall_") and "(" not in name]
    return [Instruction(n, row[source], _number(row[samples]), _number(row[executed]),
                        {name: _number(row[i]) for i, name in reasons if _number(row[i])})
            for n, row in enumerate(r for r in rows[start + 1:] if len(r) == len(head))]


def format_rows(instructions: list[Instruction], picked: list[int]) -> list[str]:
    total = sum(ins.samples for ins in instructions) or 1.0
    lines = []
    for n in picked:
        ins = instructions[n]
        top = sorted(ins.stalls.items(), key=lambda kv: -kv[1])[:3]
        why = ", ".join(f"{name[6:]} {value / total * 100:.1f}%" for name, value in top)
        lines.append(f"{n:6d} {ins.samples / total * 100:5.1f}% {ins.executed:12.0f}  {ins.source[:72]:72s} {why}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=20, help="this many instructions with the most samples")
    parser.add_argument("--at", type=int, nargs="+", help="the instructions around these indices instead")
    args = parser.parse_args(argv)
    instructions = read(args.csv)
    if args.at:
        picked = sorted({i for at in args.at for i in range(max(0, at - 6), min(len(instructions), at + 3))})
    else:
        picked = sorted(sorted(range(len(instructions)), key=lambda i: -instructions[i].samples)[:args.top])
    print(f"{len(instructions)} instructions, {sum(i.samples for i in instructions):.0f} samples")
    print(f"{'index':>6s} {'share':>6s} {'executed':>12s}  {'instruction':72s} largest stalls")
    print("\n".join(format_rows(instructions, picked)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
