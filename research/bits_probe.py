"""Which launch choices change a row's bits? A fixed token alone and in batches of 300 and 3,000, through each
format's kernels at forced tile heights, steps, warps and splits; prints the groups of launches whose rows are
bitwise equal (GPU). `python -m research.bits_probe [out.json]`."""
from __future__ import annotations

import argparse
import hashlib
import json
import traceback
from pathlib import Path

import torch

from moefuse.config import MoEConfig
from moefuse.dispatch import moe_dispatch
from moefuse.experts import persistent
from moefuse.experts.bf16 import gemm1_swiglu, gemm2
from moefuse.experts.configs import GemmTiles
from moefuse.experts.fp8.kernels import experts_fp8
from moefuse.experts.mxfp4 import ws as mxfp4_ws
from moefuse.experts.mxfp4.kernels import experts_mxfp4
from moefuse.layer import MoELayer
from moefuse.route import router_logits

dev = "cuda"
report = {}


def h(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:10]


def rows_for(token_idx, plan, out, K):
    idx = plan.expanded_to_permuted.long()[token_idx * K:(token_idx + 1) * K]
    return out[idx]


def groups(results):
    g = {}
    for name, digest in results.items():
        g.setdefault(digest, []).append(name)
    return list(g.values())


def batch(x1, m, at, H):
    xb = torch.randn(m, H, device=dev, dtype=torch.bfloat16) * 3
    xb[at] = x1[0]
    return xb


def ids_batch(ids1, m, at, E, K):
    ib = torch.rand(m, E, device=dev).topk(K, dim=1).indices.int()
    ib[at] = ids1[0]
    return ib


def tiles(bn, bk, g, w, s):
    return GemmTiles(bn, bk, g, w, s)


# ---------------- bf16 -----------------
def probe_bf16():
    c = MoEConfig(7168, 2048, 16, 8)
    layer = MoELayer(c, device=dev).init_random_(0)
    w1, w2 = layer.experts.weights()
    E, K, H, I = 16, 8, 7168, 2048
    x1 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    ids1 = torch.randperm(E, device=dev)[:K].int()[None]
    res = {}
    variants = [
        (16, tiles(128, 128, 1, 8, 3), tiles(128, 128, 1, 4, 4)),
        (16, tiles(128, 64, 1, 8, 3), tiles(128, 64, 1, 4, 3)),
        (16, tiles(64, 64, 1, 4, 4), tiles(64, 64, 1, 4, 3)),
        (32, tiles(128, 64, 1, 8, 3), tiles(128, 128, 1, 4, 4)),
        (64, tiles(128, 64, 0, 8, 4), tiles(128, 64, 0, 8, 4)),
        (64, tiles(128, 128, 0, 8, 3), tiles(128, 128, 0, 8, 3)),
        (64, tiles(64, 64, 0, 4, 4), tiles(64, 64, 0, 4, 4)),
        (128, tiles(128, 64, 0, 8, 4), tiles(256, 64, 0, 8, 4)),
        (128, tiles(128, 64, 4, 8, 4), tiles(128, 64, 4, 8, 4)),
    ]
    for m, at in ((1, 0), (300, 123), (3000, 2999)):
        xb = x1 if m == 1 else batch(x1, m, at, H)
        ib = ids1 if m == 1 else ids_batch(ids1, m, at, E, K)
        for bm, t1, t2 in variants:
            plan = moe_dispatch(ib, E, bm)
            inter = torch.empty(plan.num_rows, I, dtype=torch.bfloat16, device=dev)
            out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=dev)
            try:
                gemm1_swiglu(xb, w1, plan, inter, t1, None, use_pdl=False)
                gemm2(inter, w2, plan, out, t2, use_pdl=False)
            except Exception as exc:  # noqa: BLE001
                print("bf16 fail", bm, t1, t2, str(exc)[:100])
                continue
            res[f"M{m} bm{bm} g1{t1.block_n}x{t1.block_k}w{t1.num_warps}s{t1.num_stages} g2{t2.block_n}x{t2.block_k}"
                f"w{t2.num_warps}"] = h(rows_for(at, plan, out, K))
        if m >= 300:
            plan = moe_dispatch(ib, E, 128)
            out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=dev)
            persistent.experts_persistent(xb, w1, w2, plan, out, None)
            res[f"M{m} persistent bf16"] = h(rows_for(at, plan, out, K))
    report["bf16"] = groups(res)
    # the shared expert on nn.Linear (cuBLAS) and the router linear
    lin = torch.nn.Linear(H, I, bias=False, device=dev, dtype=torch.bfloat16)
    res = {}
    wr = torch.randn(256, H, device=dev)
    res_r = {}
    for m in (1, 2, 8, 16, 17, 64, 256, 1023, 1024, 4096):
        xb = x1 if m == 1 else batch(x1, m, m // 2, H)
        at = 0 if m == 1 else m // 2
        res[f"linear M{m}"] = h(lin(xb)[at])
        res_r[f"router M{m}"] = h(router_logits(xb, wr)[at])
    report["cublas_linear"] = groups(res)
    report["router"] = groups(res_r)


# ---------------- fp8 -----------------
def probe_fp8():
    c = MoEConfig(7168, 2048, 16, 8)
    layer = MoELayer(c, device=dev, quant="fp8").init_random_(0)
    w1, w2 = layer.experts.weights()
    E, K, H = 16, 8, 7168
    x1 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    ids1 = torch.randperm(E, device=dev)[:K].int()[None]
    res = {}
    for m, at in ((1, 0), (300, 123), (3000, 2999)):
        xb = x1 if m == 1 else batch(x1, m, at, H)
        ib = ids1 if m == 1 else ids_batch(ids1, m, at, E, K)
        for bm, t1, t2, split in (
            (16, tiles(128, 256, 1, 8, 3), tiles(128, 256, 1, 4, 3), 1),
            (16, tiles(128, 128, 1, 8, 4), tiles(128, 128, 1, 4, 4), 1),
            (16, tiles(128, 256, 1, 8, 3), tiles(128, 256, 1, 4, 3), 2),
            (16, tiles(128, 256, 1, 8, 3), tiles(128, 256, 1, 4, 3), 3),
            (64, tiles(128, 128, 0, 8, 4), tiles(128, 128, 0, 4, 4), 1),
            (64, tiles(128, 128, 0, 4, 4), tiles(128, 128, 0, 4, 4), 1),
            (64, tiles(128, 256, 1, 8, 3), tiles(128, 256, 1, 4, 3), 1),
            (64, tiles(128, 128, 0, 8, 4), tiles(128, 128, 0, 4, 4), 2),
        ):
            plan = moe_dispatch(ib, E, bm)
            out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=dev)
            try:
                experts_fp8(xb, w1, w2, plan, out, t1, t2, None, split_k=split)
                res[f"M{m} bm{bm} bk{t1.block_k} w{t1.num_warps} split{split}"] = h(rows_for(at, plan, out, K))
            except Exception as exc:  # noqa: BLE001
                print("fp8 fail", m, bm, split, exc)
        plan = moe_dispatch(ib, E, 128)
        out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=dev)
        persistent.experts_persistent_fp8(xb, w1, w2, plan, out, None)
        res[f"M{m} persistent fp8"] = h(rows_for(at, plan, out, K))
    report["fp8"] = groups(res)


# ---------------- mxfp4 -----------------
def probe_mxfp4():
    c = MoEConfig(4096, 2048, 16, 6, swiglu_limit=10.0)
    layer = MoELayer(c, device=dev, quant="mxfp4").init_random_(0)
    w1, w2 = layer.experts.weights()
    E, K, H = 16, 6, 4096
    x1 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    ids1 = torch.randperm(E, device=dev)[:K].int()[None]
    res = {}
    for m, at in ((1, 0), (300, 123), (3000, 2999)):
        xb = x1 if m == 1 else batch(x1, m, at, H)
        ib = ids1 if m == 1 else ids_batch(ids1, m, at, E, K)
        for bm in (16, 32, 64, 128):
            plan = moe_dispatch(ib, E, bm)
            out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=dev)
            mxfp4_ws.experts_mxfp4_ws(xb, w1, w2, plan, out, 10.0)
            res[f"M{m} ws bm{bm}"] = h(rows_for(at, plan, out, K))
            for t in (tiles(128, 128, 1, 8, 3), tiles(64, 256, 1, 4, 4)):
                out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=dev)
                try:
                    experts_mxfp4(xb, w1, w2, plan, out, t, t, 10.0)
                    res[f"M{m} tl bm{bm} {t.block_n}x{t.block_k}"] = h(rows_for(at, plan, out, K))
                except Exception as exc:  # noqa: BLE001
                    print("mxfp4 tl fail", bm, t, exc)
        # W4A8
        from moefuse.experts.mxfp4 import w4a8
        plan = moe_dispatch(ib, E, 128)
        out = torch.empty(plan.num_rows, H, dtype=torch.bfloat16, device=dev)
        w4a8.experts_mxfp4_w4a8(xb, w1, w2, plan, out, 10.0)
        res[f"M{m} w4a8"] = h(rows_for(at, plan, out, K))
    report["mxfp4"] = groups(res)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="write the groups to this JSON file too")
    args = parser.parse_args(argv)
    for name, fn in (("bf16", probe_bf16), ("fp8", probe_fp8), ("mxfp4", probe_mxfp4)):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report what failed, probe the rest
            traceback.print_exc()
            report[name + "_error"] = repr(exc)[:500]
        torch.cuda.empty_cache()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
