"""Readable tables for benchmark and check results: rows are dicts, columns name the keys to show."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ANCHORS = Path(__file__).with_name("anchors_h200.json")


def anchors() -> dict[str, Any]:
    """What the best public kernels measured on one H200 (see the file's ``what`` and ``how`` fields)."""
    return json.loads(ANCHORS.read_text())


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
