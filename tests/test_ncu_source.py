"""``scripts/ncu_source.py``: the per-instruction stall summary of an Nsight Compute source export, on a small
export written in ncu's column layout (quoted, thousands separators, the "(Not Issued)" copies of each reason)."""
import csv
from pathlib import Path

import pytest
from scripts_loader import script

ncu_source = script("ncu_source")

HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
        "# Samples", "Instructions Executed", "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)",
        "stall_long_sb (Not Issued)"]
ROWS = [  # address, source, samples, not issued, #, executed, barrier, long_sb, (not issued copies)
    ["0x10", "BAR.SYNC.DEFER_BLOCKING 0x1", "0", "0", "0", "264", "0", "0", "0", "0"],
    ["0x20", "NOP", "2,500", "2,400", "2,500", "269", "2,500", "0", "2,400", "0"],
    ["0x30", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R3", "10", "9", "10", "917,504", "0", "10", "0", "9"],
    ["0x40", "@!P1 BRA 0x30", "7,490", "7,000", "7,490", "917,504", "0", "7,490", "0", "7,000"],
]


def export(tmp_path: Path, rows=ROWS, head=HEAD) -> Path:
    path = tmp_path / "source.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f, quoting=csv.QUOTE_ALL)
        writer.writerow(["==PROF== a line ncu may print first"])
        writer.writerow(head)
        writer.writerows(rows)
    return path


def test_reads_counts_and_reasons(tmp_path):
    instructions = ncu_source.read(export(tmp_path))
    assert [i.source.split()[0] for i in instructions] == [
        "BAR.SYNC.DEFER_BLOCKING", "NOP", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "@!P1"]
    nop, branch = instructions[1], instructions[3]
    assert (nop.samples, nop.executed, nop.stalls) == (2500.0, 269.0, {"stall_barrier": 2500.0})
    assert (branch.samples, branch.executed, branch.stalls) == (7490.0, 917504.0, {"stall_long_sb": 7490.0})


def test_rows_give_each_instruction_its_share_of_all_samples(tmp_path):
    instructions = ncu_source.read(export(tmp_path))
    nop, branch = ncu_source.format_rows(instructions, [1, 3])
    assert " 25.0% " in nop and "barrier 25.0%" in nop and nop.split()[0] == "1"
    assert " 74.9% " in branch and "long_sb 74.9%" in branch


def test_not_an_ncu_source_export_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no header"):
        ncu_source.read(export(tmp_path, head=["a", "b"], rows=[["1", "2"]]))
