"""Which stage makes a layer's time rise where its routed experts' does not? (GPU.)

The H100 layer sweep has Kimi-K2 fp8 rise 3.6% from 544 to 672 tokens and fall back at 704 while the routed experts
alone (the tuning's times) rise 0.8%, on the same persistent kernels throughout (``tests/test_sweep.py``). This
times the layer's stages at each token count, default settings, under CUDA-graph replay: the gate (router linear +
fused gate), the routed experts (dispatch, both GEMMs, combine), the shared expert alone, and the whole layer; and the
layer with its shared expert forced each way, as a slot of the grouped GEMMs (``slot_us``) and on the side stream
(``side_us``), where it has a slot. Prints one JSON object a line.

    python -m research.layer_rise [--model kimi-k2] [--quant fp8] [--tokens 512 544 ... 1024]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from moefuse.config import preset
from moefuse.layer import MoELayer, routed_experts
from research.invariant_one_token import _us


def stages(layer: MoELayer, M: int, gen: torch.Generator) -> dict:
    """The default layer's stages at M tokens, µs."""
    c = layer.config
    x = torch.randn(M, c.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate_up, down = layer.experts.weights()
    with torch.no_grad():
        weights, ids = layer.gate(x)
        row = {"M": M, "gate": _us(partial(layer.gate, x)),
               "routed": _us(partial(routed_experts, x, gate_up, down, weights, ids, swiglu_limit=c.swiglu_limit,
                                     activation_quant=layer.activation_quant)),
               "shared": _us(partial(layer.shared_experts, x)) if layer.shared_experts is not None else None,
               "layer": _us(partial(layer, x)), "slot": layer.uses_shared_slot(M, x.device)}
        if layer.shared_slot_weights() is not None:
            saved = layer.shared_slot_max_tokens
            for name, limit in (("slot_us", M), ("side_us", 0)):
                layer.shared_slot_max_tokens = limit
                row[name] = _us(partial(layer, x))
            layer.shared_slot_max_tokens = saved
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="kimi-k2")
    parser.add_argument("--quant", default="fp8", help="fp8, mxfp4 or bf16")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(range(512, 1025, 32)))
    args = parser.parse_args(argv)
    layer = MoELayer(preset(args.model), device="cuda", quant=None if args.quant == "bf16" else args.quant)
    layer.init_random_(0)
    gen = torch.Generator("cuda").manual_seed(0)
    for M in args.tokens:
        print(json.dumps({"model": args.model, "quant": args.quant, **stages(layer, M, gen)}), flush=True)


if __name__ == "__main__":
    main()
