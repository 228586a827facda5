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
import statistics

import torch

import moefuse
from moefuse.bench.report import format_table
from moefuse.testing import rel_error

# The tiny models of tests/test_hf.py (2 layers, hidden 48, 16 experts), built the same way.
COMMON = dict(vocab_size=128, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, num_experts=16, num_experts_per_tok=4, head_dim=12,
                                              norm_topk_prob=True))


def _glm4_moe():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    return Glm4MoeForCausalLM(Glm4MoeConfig(**COMMON, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                                            first_k_dense_replace=0, head_dim=12))


MODELS = {"deepseek-v3": _deepseek_v3, "qwen3-moe": _qwen3_moe, "glm4-moe": _glm4_moe}


def _model(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    with torch.no_grad():  # transformers initialises the expert biases to zero: make them matter
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape) * 0.1)
    return model


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
