"""GPU checks of the ways in (transformers, torch.compile, CUDA graphs), printed as tables.

    python scripts/gpu_integration.py

1. Tiny randomly initialised causal LMs (DeepSeek-V3, Qwen3-MoE and GLM-4-MoE: the models of ``tests/test_hf.py``)
   in bf16: logits unpatched vs ``moefuse.patch``-ed, greedy generation of 16 tokens, and the device time of one
   decode-sized forward (one token) before and after patching.
2. ``torch.compile(fullgraph=True)`` of a MoELayer (scaled-down DeepSeek-V3, bf16, Triton kernels), eager and
   inside a captured CUDA graph, against the eager layer.

``results/INTEGRATION.md`` is written from its output.
"""

from __future__ import annotations

import argparse

import torch

import moefuse
from moefuse.bench.report import format_table
from moefuse.bench.timing import event_time_us
from moefuse.testing import TINY_CAUSAL_LMS, rel_error, tiny_causal_lm

MODELS = TINY_CAUSAL_LMS


def _model(name: str, seed: int) -> torch.nn.Module:
    return tiny_causal_lm(name, seed)


def _forward_us(fn, reps: int = 30) -> float:
    """Median device time of ``fn`` (CUDA events around each call, after warm-up)."""
    return event_time_us(fn, reps=reps)


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


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print(format_table(transformers_rows(), [
        ("model", "model"), ("logits_err", "logits rel err (bf16)"), ("same_tokens", "greedy tokens equal /16"),
        ("decode_before_us", "1-token forward, transformers µs"), ("decode_after_us", "patched µs")],
        "transformers: tiny causal LMs in bf16, unpatched vs moefuse.patch"), flush=True)
    print(format_table(compile_rows(), [("M", "M"), ("compiled_err", "compile vs eager"),
                                        ("graph_err", "compiled + CUDA graph replay vs eager")],
                       "torch.compile(fullgraph=True) of MoELayer (DeepSeek-V3 routing, H=1024, bf16)"), flush=True)


if __name__ == "__main__":
    main()
