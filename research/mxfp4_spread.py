"""Where does the MXFP4 layer's time spread come from? DeepSeek-V4-Flash at 32-640 tokens: the experts alone over six
routing draws each (with the draw's tile count, timed twice), then the layer and its stages (router, shared expert,
routed experts, the layer with the shared expert forced onto the side stream); last, one plan each at 32 and 448
tokens on four copies of the same weights, each allocated after a pad of a different size (their physical
placement differs, their values do not). Run it in fresh processes and on several machines: a spread that follows
the tile count is the routing's; one between copies on the same plan is the memory placement's; one between
processes on the same draw and copy is the machine's (GPU). `python -m research.mxfp4_spread OUT.json [seed]`."""
import json
import sys

import torch

from moefuse.bench import sweep
from moefuse.config import preset
from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts, plan_block_m
from moefuse.layer import MoELayer


def main() -> None:
    c = preset("deepseek-v4-flash")
    layer = MoELayer(c, device="cuda", quant="mxfp4").init_random_(0)
    w1, w2 = layer.experts.weights()
    out = {"experts": [], "layer": []}
    gen = torch.Generator("cuda").manual_seed(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    for M in (32, 256, 448, 640):
        x = torch.randn(M, c.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
        bm = plan_block_m(M, w1, c.top_k, x.dtype)
        for draw in range(6):
            ids = torch.rand(M, c.num_experts, device="cuda", generator=gen).topk(c.top_k, dim=1).indices.int()
            plan = moe_dispatch(ids, c.num_experts, bm)
            tiles = int((plan.tile_expert >= 0).sum())
            us = sweep._time_us(lambda: moe_experts(x, w1, w2, plan, swiglu_limit=c.swiglu_limit))
            us2 = sweep._time_us(lambda: moe_experts(x, w1, w2, plan, swiglu_limit=c.swiglu_limit))
            out["experts"].append({"M": M, "block_m": bm, "draw": draw, "tiles": tiles, "us": us, "us_again": us2})
        with torch.no_grad():
            row = {"M": M, "layer_us": sweep._time_us(lambda: layer(x)),
                   "router_us": sweep._time_us(lambda: layer.gate(x)),
                   "shared_us": sweep._time_us(lambda: layer._shared(x))}
            weights, ids = layer.gate(x)
            row["routed_us"] = sweep._time_us(lambda: layer.experts(x, weights, ids, defer=False))
            layer.shared_slot_max_tokens = 0
            row["layer_side_us"] = sweep._time_us(lambda: layer(x))
            layer.shared_slot_max_tokens = None
            row["slot"] = layer.uses_shared_slot(M, x.device)
        out["layer"].append(row)
        print(json.dumps(row), flush=True)
    for r in out["experts"]:
        print(r)
    out["placement"] = placement(c, w1, w2, gen)
    for r in out["placement"]:
        print(json.dumps(r), flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)


def placement(c, w1, w2, gen) -> list:  # noqa: ANN001 - a probe
    """The same plan on copies of the weights at other physical addresses."""
    rows, keep = [], []
    for M in (32, 448):
        x = torch.randn(M, c.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
        ids = torch.rand(M, c.num_experts, device="cuda", generator=gen).topk(c.top_k, dim=1).indices.int()
        plan = moe_dispatch(ids, c.num_experts, plan_block_m(M, w1, c.top_k, x.dtype))
        row = {"M": M, "us": []}
        for copy in range(4):
            if copy:
                keep.append(torch.empty(int(37e6 * copy) + 4096 * copy, dtype=torch.uint8, device="cuda"))
                a, b = (type(w)(w.values.clone(), w.scales.clone()) for w in (w1, w2))
                keep.append((a, b))  # alive, so the next copy cannot reuse its memory
            else:
                a, b = w1, w2
            row["us"].append([round(sweep._time_us(lambda: moe_experts(x, a, b, plan, swiglu_limit=c.swiglu_limit)),
                                    1) for _ in range(2)])
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
