"""The sharded MoE layer on W GPUs (torchrun), per mode: dispatch, experts, combine and the whole layer, the bytes
each GPU moves and the rate, beside NCCL's own all-to-all and all-reduce on the same bytes (measured in the same
run) and the single-GPU layer's time for the same per-GPU work.

    torchrun --nproc-per-node W scripts/bench_parallel.py [--preset deepseek-v3] [--tokens 1 16 128 4096]

Times are the median over ranks' medians of CUDA-event times of eager calls (a barrier before each), in µs.
Writes ``results/parallel_w<W>.json`` and ``.md`` (rank 0). The single-GPU reference is a MoELayer with E/W
experts (top-k at most E/W, no groups) at the same tokens per rank: the expert work one rank does in EP.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from moefuse import MoELayer, preset
from moefuse.bench.report import format_table
from moefuse.parallel import ShardedMoELayer


def _time(fn, iters: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    samples = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    mine = torch.tensor([statistics.median(samples)], device="cuda")
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return statistics.median(t.item() for t in everyone)


def _phases(layer: ShardedMoELayer, x: torch.Tensor) -> dict[str, float]:
    exchange = layer.dispatch(x)
    layer.compute(exchange)
    return {"dispatch_us": _time(lambda: layer.dispatch(x)),
            "experts_us": _time(lambda: layer.compute(exchange)),
            "combine_us": _time(lambda: layer.combine(exchange)),
            "layer_us": _time(lambda: layer(x))}


def _bytes_moved(layer: ShardedMoELayer, x: torch.Tensor) -> int:
    """Bytes this GPU sends (and receives as many, about) per call: rows of the all-to-all both ways, or the
    all-reduce's payload."""
    elem = x.element_size()
    if layer.mode != "ep-a2a":
        return x.numel() * elem
    exchange = layer.dispatch(x)
    rows = exchange.recv_rows.shape[0]
    return 2 * rows * x.shape[1] * elem


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 4096])
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    config = preset(args.preset)
    per_rank = config.num_experts // world
    local = replace(config, num_experts=per_rank, top_k=min(config.top_k, per_rank), num_expert_group=1, topk_group=1)
    rows = []
    with torch.no_grad():
        single = MoELayer(local, dtype=torch.bfloat16, device="cuda").init_random_(0)
        for mode, capacity in (("ep", None), ("tp", None), ("ep-a2a", None), ("ep-a2a", "worst")):
            for tokens in args.tokens:
                cap = tokens * config.top_k if capacity == "worst" else None
                layer = ShardedMoELayer(config, mode, capacity=cap, dtype=torch.bfloat16, device="cuda").init_random_(0)
                x = torch.randn(tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16)
                row = {"mode": mode + ("" if cap is None else " (capacity)"), "M": tokens, **_phases(layer, x)}
                moved = _bytes_moved(layer, x)
                row["bytes"] = moved
                payload = torch.empty(moved // 2, device="cuda", dtype=torch.bfloat16)
                if mode == "ep-a2a":
                    out = torch.empty_like(payload)
                    row["nccl_us"] = _time(lambda: dist.all_to_all_single(out, payload))
                else:
                    row["nccl_us"] = _time(lambda: dist.all_reduce(payload))
                comm_us = row["dispatch_us"] + row["combine_us"] if mode == "ep-a2a" else row["combine_us"]
                row["gbps"] = moved / (comm_us * 1e-6) / 1e9
                row["nccl_gbps"] = moved / (row["nccl_us"] * 1e-6) / 1e9
                row["single_gpu_us"] = _time(lambda: single(x))
                rows.append(row)
                del layer
                torch.cuda.empty_cache()
    if rank == 0:
        columns = [("mode", "mode"), ("M", "tokens per rank"), ("dispatch_us", "dispatch µs"),
                   ("experts_us", "experts µs"), ("combine_us", "combine µs"), ("layer_us", "layer µs"),
                   ("bytes", "bytes moved per GPU"), ("gbps", "GB/s (dispatch + combine)"),
                   ("nccl_us", "NCCL same bytes µs"), ("nccl_gbps", "NCCL GB/s"),
                   ("single_gpu_us", "single-GPU layer, E/W experts µs")]
        import triton

        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        env = (f"{datetime.date.today().isoformat()}, {world} × {torch.cuda.get_device_name()}, torch "
               f"{torch.__version__}, Triton {triton.__version__}, NCCL {nccl}")
        table = format_table(rows, columns, f"{args.preset} sharded over {world} GPU(s), bf16 ({env})")
        print(table)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"parallel_w{world}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        (out / f"parallel_w{world}.md").write_text(table + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
