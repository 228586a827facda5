"""``scripts/ncu_table.py``: Nsight Compute's raw CSV read into one line per kernel, in the columns' units."""
import pytest
from scripts_loader import script

ncu_table = script("ncu_table")

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
# the shape of `ncu --csv --page raw`: ncu's log lines, a header, a units row, a row a kernel (values with commas)
RAW = "\n".join([
    "==PROF== Connected to process 582 (/usr/bin/python3.12)",
    '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","lts__t_bytes.sum","sm__inst_executed.sum",'
    f'"{STALL.format("long_scoreboard")}","{STALL.format("wait")}","{STALL.format("barrier")}"',
    '"","","ns","Mbyte","byte","inst","","",""',
    '"0","_gemm1_fp8_kernel(...)","72,312","235.5","1,000,000,000","24,100,000","1.14","1.03","0.89"',
    '"1","_gemm2_fp8_kernel","36,700","117.0","","4,300,000","9.51","0.2","n/a"',
])


def test_reads_each_kernel_in_the_columns_units_and_stalls_largest_first():
    g1, g2 = ncu_table.read(RAW)
    assert g1.name == "_gemm1_fp8_kernel(...)"
    assert g1.values["gpu__time_duration.sum"] == pytest.approx(72.312)  # ns -> µs
    assert g1.values["dram__bytes_read.sum"] == pytest.approx(0.2355)  # MB -> GB
    assert g1.values["lts__t_bytes.sum"] == pytest.approx(1.0)  # bytes -> GB
    assert g1.values["sm__inst_executed.sum"] == pytest.approx(24.1)  # millions
    assert g1.stalls == {"long_scoreboard": 1.14, "wait": 1.03, "barrier": 0.89}
    assert "lts__t_bytes.sum" not in g2.values and "barrier" not in g2.stalls  # blank and non-numbers: left out
    rows = ncu_table.table([g1, g2], stalls=2).splitlines()
    assert rows[2].startswith("| _gemm1_fp8_kernel | 72.3 | ") and rows[2].endswith("long scoreboard 1.14, wait 1.03 |")
    assert rows[3].endswith("long scoreboard 9.51, wait 0.20 |")


def test_metrics_name_every_column_and_the_stalls():
    names = ncu_table.metrics().split(",")
    assert [metric for metric, _ in ncu_table.COLUMNS] == names[:-1]
    assert names[-1] == "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"


def test_input_without_a_header_is_refused():
    with pytest.raises(ValueError, match="header"):
        ncu_table.read("==ERROR== An error occurred while trying to profile.\n")
