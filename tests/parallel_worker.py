"""What each process of tests/test_parallel.py runs (a module of its own, so spawned processes can import it)."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

from moefuse import MoEConfig, MoELayer, _runtime
from moefuse.parallel import ShardedMoELayer
from moefuse.testing import rel_error

CONFIGS = {
    # grouped sigmoid router with an expert bias, a shared expert
    "deepseek-v3-shaped": MoEConfig(hidden_size=40, intermediate_size=24, num_experts=16, top_k=3,
                                    num_shared_experts=1, num_expert_group=4, topk_group=2,
                                    routed_scaling_factor=2.5),
    # softmax router, no bias, no shared expert
    "qwen3-shaped": MoEConfig(hidden_size=40, intermediate_size=16, num_experts=8, top_k=2, scoring_func="softmax",
                              expert_bias=False),
}
TOL = 1e-5


def _layer(config: MoEConfig, seed: int) -> MoELayer:
    return MoELayer(config, dtype=torch.float32).init_random_(seed, std=0.1)


def _tokens(config: MoEConfig, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, config.hidden_size, generator=torch.Generator().manual_seed(seed))


def _check(name: str, got: torch.Tensor, want: torch.Tensor, failures: list[str]) -> None:
    err = rel_error(got, want)
    if got.shape != want.shape or not err <= TOL:
        failures.append(f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}, rel err {err:.2e}")


def _replicated_modes(rank: int, world: int, failures: list[str]) -> None:
    """'ep' and 'tp' (and both ways of running the shared expert, and the reduce-scatter) equal the full layer."""
    for cname, config in CONFIGS.items():
        layer = _layer(config, seed=11)
        x = _tokens(config, 4 * world, seed=12)
        with torch.no_grad():
            want = layer(x)
            padded = layer(x, num_token_non_padded=3)
            for mode in ("ep", "tp"):
                for shared in ("tp", "rank0"):
                    sharded = ShardedMoELayer.from_layer(layer, mode, shared=shared)
                    _check(f"{cname} {mode} shared={shared}", sharded(x), want, failures)
                    _check(f"{cname} {mode} shared={shared} padded", sharded(x, num_token_non_padded=3), padded,
                           failures)
                scattered = ShardedMoELayer.from_layer(layer, mode, scatter_output=True)(x)
                rows = slice(rank * 4, (rank + 1) * 4)
                _check(f"{cname} {mode} scatter_output", scattered, want[rows], failures)


def _all_to_all_modes(rank: int, world: int, failures: list[str]) -> None:
    """'ep-a2a', exact counts and fixed capacity: each rank's tokens (rank 0 has none) equal the full layer's."""
    counts = [0] + [3 + r for r in range(1, world)]  # rank 0: no tokens at all
    for cname, config in CONFIGS.items():
        layer = _layer(config, seed=21)
        x = _tokens(config, counts[rank], seed=100 + rank)
        with torch.no_grad():
            want = layer(x)
            padded = layer(x, num_token_non_padded=2)
            for capacity in (None, max(counts) * config.top_k):
                sharded = ShardedMoELayer.from_layer(layer, "ep-a2a", capacity=capacity)
                _check(f"{cname} ep-a2a capacity={capacity}", sharded(x), want, failures)
                _check(f"{cname} ep-a2a capacity={capacity} padded", sharded(x, num_token_non_padded=2), padded,
                       failures)


QUANT_CONFIG = MoEConfig(hidden_size=64, intermediate_size=256, num_experts=8, top_k=3, num_shared_experts=1,
                         num_expert_group=2, topk_group=1, routed_scaling_factor=2.5)
QUANT_TOL = 1e-2  # bf16 activations: the sharded shared expert's output is rounded before it joins the sum


def _quantized_modes(rank: int, world: int, failures: list[str]) -> None:
    """fp8 and MXFP4 layers (bf16 activations, fp8 shared expert): every mode their blocks allow on this world."""
    config = QUANT_CONFIG
    for quant in ("fp8", "mxfp4"):
        layer = MoELayer(config, quant=quant).init_random_(seed=51, std=0.1)
        x = _tokens(config, 2 * world, seed=52).bfloat16()
        mine = _tokens(config, 2 + rank, seed=60 + rank).bfloat16()
        step = 128 if quant == "fp8" else 32
        with torch.no_grad():
            want, want_mine = layer(x), layer(mine)
            for mode in ("ep", "tp", "ep-a2a"):
                if mode == "tp" and (config.intermediate_size // world) % step:
                    continue  # refused, checked below
                shared = "tp" if (config.shared_intermediate_size // world) % 128 == 0 else "rank0"
                sharded = ShardedMoELayer.from_layer(layer, mode, shared=shared)
                tokens, expected = (mine, want_mine) if mode == "ep-a2a" else (x, want)
                err = rel_error(sharded(tokens), expected)
                if not err <= QUANT_TOL:
                    failures.append(f"{quant} {mode} shared={shared}: rel err {err:.2e}")
    if (config.intermediate_size // world) % 128:
        try:
            ShardedMoELayer.from_layer(MoELayer(config, quant="fp8").init_random_(), "tp")
            failures.append("fp8 tp with I/world not a multiple of 128: no ValueError")
        except ValueError:
            pass


def _experts_elsewhere(rank: int, world: int, failures: list[str]) -> None:
    """Every token routed to the last rank's experts only: the other ranks' experts get nothing."""
    config = CONFIGS["deepseek-v3-shaped"]
    layer = _layer(config, seed=31)
    with torch.no_grad():
        per_rank = config.num_experts // world
        layer.gate.e_score_correction_bias.fill_(-100.0)
        layer.gate.e_score_correction_bias[-per_rank:] = 100.0  # selection only: weights still from the scores
        layer.gate.weight.zero_()  # equal scores: the bias alone decides
        x = _tokens(config, 5, seed=32)
        want = layer(x)
        for mode in ("ep", "ep-a2a"):
            for capacity in ((None,) if mode == "ep" else (None, 5 * config.top_k)):
                sharded = ShardedMoELayer.from_layer(layer, mode, capacity=capacity)
                _check(f"experts on one rank, {mode} capacity={capacity}", sharded(x), want, failures)


def _batch_invariant_modes(rank: int, world: int, failures: list[str]) -> None:
    """With ``batch_invariant=True`` (Triton backend) a token's output is bitwise the same alone and inside batches
    of other tokens (huge ones among them), in every mode: each rank's partial outputs are added in rank order, not
    by a collective whose order follows the message size (which four ranks can show, two cannot: a + b is b + a). In
    ep-a2a each rank has the token among its own. The ranks hold CPU tensors: on a GPU machine, where Triton runs
    compiled, they have no Triton backend, and this runs in the CPU suite only."""
    if not _runtime.interpreting():
        return
    config = CONFIGS["deepseek-v3-shaped"]
    layer = MoELayer(config, dtype=torch.float32, backend="triton", batch_invariant=True).init_random_(71, std=0.1)
    token = _tokens(config, 1, seed=72)
    with torch.no_grad():
        for mode in ("ep", "tp", "ep-a2a"):
            sharded = ShardedMoELayer.from_layer(layer, mode)
            alone = sharded(token)[0]
            for M in (7, 40):
                batch = _tokens(config, M, seed=73 + rank)
                batch[::3] *= 300.0
                for at in (0, M - 1):
                    got = sharded(torch.cat([batch[:at], token, batch[at + 1:]]))[at]
                    if not torch.equal(got, alone):
                        failures.append(f"batch-invariant {mode}: the token at {at} of {M} differs from it alone by "
                                        f"{(got - alone).abs().max():.2e}")


def _errors(rank: int, world: int, failures: list[str]) -> None:
    """Shapes that do not split, a capacity that is too small: a ValueError on every rank, no hang."""
    odd = MoEConfig(hidden_size=8, intermediate_size=6, num_experts=world * 2 + 1, top_k=1)
    cases = [
        ("experts", lambda: ShardedMoELayer(odd, "ep", dtype=torch.float32)),
        ("intermediate", lambda: ShardedMoELayer(MoEConfig(hidden_size=8, intermediate_size=world * 2 + 1,
                                                           num_experts=world, top_k=1), "tp", dtype=torch.float32)),
        ("mode", lambda: ShardedMoELayer(odd, "dp", dtype=torch.float32)),
    ]
    config = CONFIGS["qwen3-shaped"]
    small = ShardedMoELayer.from_layer(_layer(config, seed=41), "ep-a2a", capacity=1)
    cases.append(("capacity", lambda: small(_tokens(config, 6, seed=42))))
    for name, make in cases:
        try:
            make()
        except ValueError:
            continue
        failures.append(f"no ValueError for bad {name}")


def worker(rank: int, world: int, init_file: str, errors_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    failures: list[str] = []
    try:
        for part in (_replicated_modes, _all_to_all_modes, _quantized_modes, _experts_elsewhere,
                     _batch_invariant_modes, _errors):
            part(rank, world, failures)
    except Exception:  # noqa: BLE001 - reported to the test below, with the traceback
        failures.append(traceback.format_exc())
    finally:
        dist.destroy_process_group()
    if failures:
        with open(f"{errors_file}.{rank}", "w") as f:
            f.write("\n".join(failures))
