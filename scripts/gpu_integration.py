"""GPU checks of the ways in (issue: transformers, torch.compile, CUDA graphs), printed as tables.

    python scripts/gpu_integration.py

1. Tiny randomly initialised causal LMs (the test suite's DeepSeek-V3, Qwen3-MoE and GLM-4-MoE) in bf16:
   logits unpatched vs ``moefuse.patch``-ed, greedy generation of 16 tokens, and the device time of one
   decode-sized forward (one token) before and after patching.
2. ``torch.compile(fullgraph=True)`` of a MoELayer (scaled-down DeepSeek-V3, bf16, Triton kernels), eager and
   inside a captured CUDA graph, against the eager layer.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_hf import MODELS, _model  # noqa: E402

import moefuse  # noqa: E402
from moefuse.bench.report import format_table  # noqa: E402
from moefuse.testing import rel_error  # noqa: E402


def _forward_us(fn, reps: int = 30) -> float:
    """Median wall-clock device time of ``fn`` (CUDA events around each call, after warm-up)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


@torch.no_grad()
def transformers_rows() -> list[dict]:
    rows = []
    for name in sorted(MODELS):
        model = _model(name, seed=1234).to("cuda", torch.bfloat16)
        prompt = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]], device="cuda")
        step = prompt[:, :1]
        want = model(prompt).logits.float()
        want_gen = model.generate(prompt, max_new_tokens=16, do_sample=False)
        before_us = _forward_us(lambda: model(step))
        moefuse.patch(model)
        got = model(prompt).logits.float()
        got_gen = model.generate(prompt, max_new_tokens=16, do_sample=False)
        after_us = _forward_us(lambda: model(step))
        rows.append({"model": name, "logits_err": rel_error(got, want),
                     "same_tokens": int((got_gen == want_gen).sum()) - prompt.shape[1],
                     "decode_before_us": before_us, "decode_after_us": after_us})
    return rows


@torch.no_grad()
def compile_rows() -> list[dict]:
    config = moefuse.preset("deepseek-v3").scaled(hidden_size=1024, intermediate_size=256)
    layer = moefuse.MoELayer(config, dtype=torch.bfloat16, device="cuda").init_random_(0)
    rows = []
    for tokens in (1, 64):
        x = torch.randn(tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)  # one graph per decode size
        out_compiled = compiled(x)
        graph = torch.cuda.CUDAGraph()
        compiled(x)
        with torch.cuda.graph(graph):
            static = compiled(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        rows.append({"M": tokens, "compiled_err": rel_error(out_compiled, eager),
                     "graph_err": rel_error(static, layer(x))})
    return rows


def main() -> None:
    print(format_table(transformers_rows(), [
        ("model", "model"), ("logits_err", "logits rel err (bf16)"), ("same_tokens", "greedy tokens equal /16"),
        ("decode_before_us", "1-token forward, transformers µs"), ("decode_after_us", "patched µs")],
        "transformers: tiny causal LMs in bf16, unpatched vs moefuse.patch"), flush=True)
    print(format_table(compile_rows(), [("M", "M"), ("compiled_err", "compile vs eager"),
                                        ("graph_err", "compiled + CUDA graph replay vs eager")],
                       "torch.compile(fullgraph=True) of MoELayer (DeepSeek-V3 routing, H=1024, bf16)"), flush=True)


if __name__ == "__main__":
    main()
