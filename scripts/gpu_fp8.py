"""fp8 block-scale experts on a GPU: correctness at full model size, and a first timing beside bf16.

    python scripts/gpu_fp8.py [--preset deepseek-v3] [--tokens 1 16 128 1024 4096]

For each token count: dispatch + ``moe_experts`` with ``BlockFP8`` weights against the float64 reference of the same
numerics (SPEC §5) and against the unquantized bf16 weights in float64; then device time under CUDA-graph
replay (``moefuse.bench.timing``) of the fp8 and the bf16 experts on the same routing, with the fp8 weight-read
floor (touched experts' e4m3 bytes and scales at the read bandwidth measured in the same run). Not yet the
benchmark of record (no peer in the same run, no tuned fp8 tiles): a first look.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefuse.bench import timing  # noqa: E402
from moefuse.bench.report import format_table  # noqa: E402
from moefuse.config import preset  # noqa: E402
from moefuse.dispatch import moe_dispatch  # noqa: E402
from moefuse.experts import moe_experts, moe_experts_torch, pick_block_m  # noqa: E402
from moefuse.experts.reference import moe_experts_fp8_torch  # noqa: E402
from moefuse.formats import BlockFP8  # noqa: E402
from moefuse.testing import rel_error  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024, 4096])
    args = parser.parse_args()
    c = preset(args.preset)
    E, H, I, K = c.num_experts, c.hidden_size, c.intermediate_size, c.top_k
    gen = torch.Generator("cuda").manual_seed(0)
    w1 = torch.randn(E, 2 * I, H, device="cuda", generator=gen, dtype=torch.bfloat16) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device="cuda", generator=gen, dtype=torch.bfloat16) / math.sqrt(I)
    f1, f2 = BlockFP8.quantize(w1), BlockFP8.quantize(w2)
    ceilings = timing.measure_ceilings(gemm=False)
    rows = []
    for M in args.tokens:
        x = torch.randn(M, H, device="cuda", generator=gen, dtype=torch.bfloat16)
        ids = torch.rand(M, E, device="cuda", generator=gen).argsort(1)[:, :K].int()
        plan = moe_dispatch(ids, E, pick_block_m(M, E, H, I, K, torch.bfloat16))
        n = int(plan.expert_offsets[-1])
        row: dict = {"M": M}
        with torch.no_grad():
            out = moe_experts(x, f1, f2, plan)
            if M <= 512:  # the float64 oracle dequantizes each touched expert: enough to check, not at 4096
                ref = moe_experts_fp8_torch(x, f1, f2, plan, dtype=torch.float64,
                                            out=torch.zeros(plan.num_rows, H, dtype=torch.float64, device="cuda"))
                exact = moe_experts_torch(x, w1, w2, plan, dtype=torch.float64,
                                          out=torch.zeros(plan.num_rows, H, dtype=torch.float64, device="cuda"))
                row["err_spec"] = rel_error(out[:n], ref[:n])
                row["err_bf16_weights"] = rel_error(out[:n], exact[:n])
            row["fp8_us"] = timing.graph_time_us([lambda: moe_experts(x, f1, f2, plan)], replays=20)
            row["bf16_us"] = timing.graph_time_us([lambda: moe_experts(x, w1, w2, plan)], replays=20)
        touched = int(torch.unique(ids).numel())
        fp8_bytes = touched * (3 * H * I + 4 * 3 * math.ceil(H / 128) * math.ceil(I / 128))
        row["floor_us"] = ceilings.empty_us + fp8_bytes / (ceilings.read_tbps * 1e12) * 1e6
        row["x_floor"] = row["fp8_us"] / row["floor_us"]
        row["speedup"] = row["bf16_us"] / row["fp8_us"]
        rows.append(row)
        print(row, flush=True)
    print(format_table(rows, [("M", "M"), ("err_spec", "err vs f64 spec"), ("err_bf16_weights", "err vs bf16 weights"),
                              ("fp8_us", "fp8 µs"), ("bf16_us", "bf16 µs"), ("floor_us", "fp8 read floor µs"),
                              ("x_floor", "× floor"), ("speedup", "bf16 / fp8")],
                       f"{args.preset} experts, fp8 block-scale vs bf16 (CUDA-graph replay)"))


if __name__ == "__main__":
    main()
