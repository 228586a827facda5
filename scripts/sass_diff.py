"""Which default kernel launches compile to different sm_90 SASS at another revision? (No GPU needed.)

    python scripts/sass_diff.py 3cac4bd          # this checkout against revision 3cac4bd

Compiles, in this checkout and in a temporary ``git worktree`` of the revision, the launches the default paths make
(each tree with its own ``scripts/sass.py`` helpers): the router linear's decode and tensor-core launches, the
fused gate of every router config, representative ``tl`` GEMMs of each format and tile path (16-bit 16/64/128 rows,
fp8 16 rows split 1-3 and 64 rows, MXFP4 16 and 128 rows, with and without the clamp), and every Gluon kernel
(MXFP4 warp-specialized at each tile height, W4A8, the persistent 16-bit and fp8 GEMMs, static and dynamic). It
prints each launch whose SASS differs. A refactor that leaves every launch byte-identical cannot change what runs on
a GPU; one that does not needs the GPU suite. Run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def launches(root: Path) -> dict[str, str]:
    """SASS digests of the default launches, compiled by ``root``'s moefuse and ``root/scripts/sass.py``."""
    import torch

    spec = importlib.util.spec_from_file_location("sass_tool", root / "scripts" / "sass.py")
    assert spec is not None and spec.loader is not None
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    from moefuse.experts.configs import GemmTiles as T
    from moefuse.route import linear

    found: dict[str, str] = {}

    def add(name: str, build) -> None:  # noqa: ANN001 - a closure compiling one launch
        try:
            text, _ = sass.sass_stats(build().asm["cubin"])
            body = "\n".join(line for line in text.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line))
            found[name] = hashlib.sha1(body.encode()).hexdigest()[:12]
        except Exception as error:  # noqa: BLE001 - a launch that no longer compiles is a difference too
            found[name] = f"error: {type(error).__name__}"

    decode = linear._router_logits_kernel
    extra = {"ROW_BLOCKS": False} if "ROW_BLOCKS" in decode.arg_names else {}
    for H in (2048, 7168):
        for M in (1, linear.MAX_TOKENS):
            block_m, block_k = linear.block_shape(M, H)
            add(f"router linear decode H={H} M={M}", lambda block_m=block_m, block_k=block_k: sass.compile_sm90(
                decode, {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "H": "i32",
                         "stride_xm": "i32", "stride_we": "i32", "stride_om": "i32"},
                {"stride_xk": 1, "stride_wk": 1, "stride_oe": 1, "BLOCK_M": block_m, "BLOCK_K": block_k, **extra},
                linear.NUM_WARPS))
    mma = linear._router_logits_mma_kernel
    for c in linear.MMA_LAUNCHES:
        constexprs = {"stride_xk": 1, "stride_oe": 1, "UPCAST": False, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n,
                      "BLOCK_K": c.block_k, **({"SPLIT_K": 1} if "SPLIT_K" in mma.arg_names else {})}
        signature = {"x_ptr": "*bf16", "parts_ptr": "*bf16", "out_ptr": "*fp32", "M": "i32", "E": "i32", "H": "i32",
                     "stride_xm": "i32", "stride_om": "i32"}
        add(f"router linear tensor cores {c.block_m}x{c.block_n}",
            lambda c=c, constexprs=constexprs, signature=signature:
            sass.compile_sm90(mma, signature, constexprs, c.warps, c.stages, sizes=("E", "H")))
    for name, config in sass.ROUTER_CONFIGS.items():
        for block_m in (1, 2, 4):
            add(f"gate {name} BLOCK_M={block_m}", lambda config=config, block_m=block_m:
                sass.compile_router(*config, block_m))
    bf16 = torch.bfloat16
    for limit in (False, True):
        for block_m, tiles in ((16, T(128, 128, 1, 8, 3)), (64, T(128, 64, 0, 8, 4)), (128, T(128, 64, 0, 8, 4))):
            add(f"bf16 GEMM1 {block_m} rows clamp={limit}", lambda block_m=block_m, tiles=tiles, limit=limit:
                sass.compile_gemm(1, bf16, block_m, tiles, 7168, limit))
        for split in (1, 2, 3):
            add(f"fp8 GEMM1 16 rows split {split} clamp={limit}", lambda split=split, limit=limit:
                sass.compile_fp8_gemm(1, 16, T(128, 256, 1, 8, 3), limit, split))
        add(f"fp8 GEMM1 64 rows clamp={limit}", lambda limit=limit:
            sass.compile_fp8_gemm(1, 64, T(128, 128, 0, 8, 4), limit))
        for block_m, tiles in ((16, T(64, 256, 1, 4, 4)), (128, T(128, 128, 4, 8, 3))):
            add(f"MXFP4 GEMM1 {block_m} rows clamp={limit}", lambda block_m=block_m, tiles=tiles, limit=limit:
                sass.compile_mxfp4_gemm(1, block_m, tiles, limit))
        for gemm in (1, 2):
            for block_m in (16, 32, 64, 128):
                add(f"MXFP4 ws GEMM{gemm} {block_m} rows clamp={limit}", lambda gemm=gemm, block_m=block_m,
                    limit=limit: sass.compile_mxfp4_ws_gemm(gemm, block_m, limit))
            add(f"W4A8 GEMM{gemm} clamp={limit}", lambda gemm=gemm, limit=limit:
                sass.compile_mxfp4_w4a8_gemm(gemm, 128, limit))
            for dtype in ("bf16", "fp8"):
                for dynamic in (False, True):
                    add(f"persistent {dtype} GEMM{gemm} dynamic={dynamic} clamp={limit}",
                        lambda gemm=gemm, dtype=dtype, dynamic=dynamic, limit=limit:
                        sass.compile_persistent_gemm(gemm, limit, dtype, dynamic))
    for block_m, tiles in ((16, T(128, 128, 1, 4, 4)), (128, T(256, 64, 0, 8, 4))):
        add(f"bf16 GEMM2 {block_m} rows", lambda block_m=block_m, tiles=tiles:
            sass.compile_gemm(2, bf16, block_m, tiles, 2048, False))
    add("fp8 GEMM2 16 rows", lambda: sass.compile_fp8_gemm(2, 16, T(128, 256, 1, 4, 3), False))
    add("fp8 GEMM2 64 rows", lambda: sass.compile_fp8_gemm(2, 64, T(128, 128, 0, 4, 4), False))
    return found


def _digests(root: Path) -> dict[str, str]:
    """:func:`launches` of ``root`` in a process of its own, importing ``root``'s moefuse."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(root)}
        subprocess.run([sys.executable, __file__, "--tree", str(root), "--out", out.name], env=env, check=True)
        return json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", nargs="?", help="the git revision to compare this checkout against")
    parser.add_argument("--tree", help=argparse.SUPPRESS)  # internal: compile one tree's launches
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tree:
        Path(args.out).write_text(json.dumps(launches(Path(args.tree))))
        return 0
    if not args.revision:
        parser.error("a revision is needed")
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(old), args.revision],
                       check=True)
        try:
            before = _digests(old)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=True)
    after = _digests(REPO)
    changed = [name for name in after if before.get(name) != after[name]]
    for name in changed:
        print(f"differs: {name} ({before.get(name, 'absent')} -> {after[name]})")
    print(f"{len(after) - len(changed)} of {len(after)} launches compile to the same SASS as {args.revision}")
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
