"""One line per kernel from Nsight Compute's raw metrics: time, DRAM and L2, issue slots, warps, largest stalls.

    ncu [--nvtx --nvtx-include "meas/"] --metrics "$(python scripts/ncu_table.py --metrics)" --csv --page raw \
        python3 PROGRAM ... > ncu.csv
    python scripts/ncu_table.py ncu.csv [--stalls 4]

Any program's kernels; ``--nvtx-include "meas/"`` keeps those launched inside an NVTX range "meas" (as
``python -m research.fp8_decode_probe --ncu-target PRESET`` opens around its calls).

The metrics (``--metrics`` prints them for ncu's command line): device time, DRAM throughput (share of peak and
bytes read), L2 throughput and bytes, issue slots busy, warps active per SM, instructions, tensor pipe (wgmma)
activity, and every "warps stalled per issue" reason, the columns the performance notes quote. A kernel's stalls
are listed largest first; a metric ncu did not give (a name this ncu does not know) is left blank, not guessed.
"""
from __future__ import annotations

import argparse
import csv
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path

# (ncu metric, column title): the fixed columns, in order
COLUMNS = [
    ("gpu__time_duration.sum", "µs"),
    ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM %"),
    ("dram__bytes_read.sum", "DRAM GB read"),
    ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "L2 %"),
    ("lts__t_bytes.sum", "L2 GB"),
    ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue busy %"),
    ("sm__warps_active.avg.per_cycle_active", "warps/SM"),
    ("sm__inst_executed.sum", "M warp instr."),
    ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "wgmma %"),
]
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")
SCALE = {  # unit (as ncu's units row spells it) -> factor to the column's unit (µs, GB, millions)
    "ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6,
    "byte": 1e-9, "Kbyte": 1e-6, "KB": 1e-6, "Mbyte": 1e-3, "MB": 1e-3, "Gbyte": 1.0, "GB": 1.0,
    "inst": 1e-6, "Kinst": 1e-3, "Minst": 1.0, "Ginst": 1e3,
}


@dataclass
class Kernel:
    name: str
    values: dict[str, float]  # column metric -> value in the column's unit
    stalls: dict[str, float] = field(default_factory=dict)  # reason -> warps stalled per issue


def metrics() -> str:
    """The ``--metrics`` argument that gives every column."""
    return ",".join([metric for metric, _ in COLUMNS] + [f"regex:{STALL[0]}.*{STALL[1]}"])


def _number(text: str) -> float | None:
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def read(text: str) -> list[Kernel]:
    """The kernels of an ``ncu --csv --page raw`` export (a header row, a units row, one row a kernel; ncu's own
    log lines before the header are skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu raw CSV header (a line starting with \"ID\") in the input")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, body = rows[0], rows[1], rows[2:]
    kernels = []
    for row in body:
        if len(row) != len(header):
            continue
        cells = dict(zip(header, row))
        unit = dict(zip(header, units))
        values = {}
        for metric, _ in COLUMNS:
            value = _number(cells.get(metric, ""))
            if value is not None:
                values[metric] = value * SCALE.get(unit.get(metric, ""), 1.0)
        stalls = {name[len(STALL[0]):-len(STALL[1])]: v for name, text in cells.items()
                  if name.startswith(STALL[0]) and name.endswith(STALL[1]) and (v := _number(text)) is not None}
        kernels.append(Kernel(cells.get("Kernel Name", "?"), values, stalls))
    return kernels


def table(kernels: list[Kernel], stalls: int = 4) -> str:
    """A markdown table, one row a kernel, its ``stalls`` largest stall reasons in the last column."""
    head = ["kernel"] + [title for _, title in COLUMNS] + ["largest stalls (warps per issue)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in kernels:
        cells = [k.name.split("(")[0][:48]]
        for metric, _ in COLUMNS:
            value = k.values.get(metric)
            cells.append("" if value is None else f"{value:.3g}" if value < 100 else f"{value:,.0f}")
        top = sorted(k.stalls.items(), key=lambda item: -item[1])[:stalls]
        cells.append(", ".join(f"{reason.replace('_', ' ')} {v:.2f}" for reason, v in top))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, nargs="?", help="ncu --csv --page raw output")
    parser.add_argument("--stalls", type=int, default=4, help="stall reasons per kernel")
    parser.add_argument("--metrics", action="store_true", help="print the --metrics argument for ncu and exit")
    args = parser.parse_args(argv)
    if args.metrics:
        print(metrics())
        return 0
    if args.csv is None:
        parser.error("a CSV file is needed (or --metrics)")
    print(table(read(args.csv.read_text(errors="replace")), args.stalls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
