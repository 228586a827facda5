"""Readable tables for benchmark and check results: rows are dicts, columns name the keys to show."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What the best public kernels measured, one file per GPU model (the file's ``measured`` field): the model's name as
# torch.cuda.get_device_name() contains it, and the file.
ANCHOR_FILES = {"H200": Path(__file__).with_name("anchors_h200.json"),
                "H100 80GB HBM3": Path(__file__).with_name("anchors_h100.json")}
ANCHORS, ANCHOR_GPU = ANCHOR_FILES["H200"], "H200"  # the names of 1.0's one anchor file, kept: the H200's


def anchors(gpu: str) -> dict[str, Any]:
    """What the best public kernels measured (each file's ``measured`` and ``how`` fields), every file's tables, for a
    run on ``gpu`` (``torch.cuda.get_device_name()``): the tables measured on another GPU model have no rows. An H100
    reads at 3.35 TB/s to the H200's 4.8, so its times beside the H200's would show a loss (or a gain) no kernel
    made. The H200 file's own fields (``measured``, ``how``, ``ceilings``) are the top level's."""
    merged: dict[str, Any] = {}
    for model, path in reversed(ANCHOR_FILES.items()):  # the H200 file last: its top-level fields win
        tables = json.loads(path.read_text())
        if model not in gpu:
            for table in tables.values():
                if isinstance(table, dict) and "rows" in table:
                    table["rows"] = []
        merged.update(tables)
    return merged


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.1e}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], title: str = "") -> str:
    """A Markdown table of ``rows``; ``columns`` is a sequence of ``(key, header)``. Missing keys print '-'."""
    cells = [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    numeric = [all(isinstance(row.get(key), (int, float)) or row.get(key) is None for row in rows)
               for key, _ in columns]
    headers = [header for _, header in columns]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [f"### {title}", ""] if title else []
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)) + " |"
              for r in cells]
    return "\n".join(lines)
