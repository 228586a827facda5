"""Dispatch: the Triton kernels equal the PyTorch reference bit for bit, and both satisfy the plan's invariants."""

import pytest
import torch

from moefuse.dispatch import DispatchPlan, max_tiles, moe_dispatch, moe_dispatch_torch
from moefuse.dispatch.kernel import dispatch_triton

FIELDS = ("expert_offsets", "permuted_to_expanded", "expanded_to_permuted", "tile_expert", "tile_row_start")


def random_ids(gen: torch.Generator, M: int, K: int, E: int, *, invalid: float = 0.0, dtype=torch.int32):
    """Distinct ids per token (as a router returns them), a fraction ``invalid`` replaced by -1 or >= E."""
    ids = torch.rand(M, max(E, K), generator=gen).argsort(dim=1)[:, :K]
    drop = torch.rand(M, K, generator=gen) < invalid
    other = torch.where(torch.rand(M, K, generator=gen) < 0.5, -1, E + torch.randint(0, 3, (M, K), generator=gen))
    return torch.where(drop, other, ids).to(dtype)


def assert_same(plan: DispatchPlan, ref: DispatchPlan) -> None:
    for name in FIELDS:
        got, want = getattr(plan, name), getattr(ref, name)
        assert torch.equal(got.cpu(), want.cpu()), f"{name}:\n got {got.tolist()}\nwant {want.tolist()}"
    assert (plan.num_experts, plan.top_k, plan.block_m) == (ref.num_experts, ref.top_k, ref.block_m)


def assert_invariants(plan: DispatchPlan, ids: torch.Tensor) -> None:
    """Everything the experts and finalize stages rely on, checked from the ids alone."""
    E, bm = plan.num_experts, plan.block_m
    flat = ids.reshape(-1).long().cpu()
    valid = (flat >= 0) & (flat < E)
    offsets = plan.expert_offsets.long().cpu()
    p2e, e2p = plan.permuted_to_expanded.long().cpu(), plan.expanded_to_permuted.long().cpu()
    n_valid = int(valid.sum())
    # counts match and segments are compact, starting at 0
    assert offsets[0] == 0 and offsets[E] == n_valid
    assert torch.equal(offsets.diff(), torch.bincount(flat[valid], minlength=E)[:E])
    # maps: rows past n_valid and slots with no expert are -1; on real rows the maps are inverse
    assert (p2e[n_valid:] == -1).all() and (e2p[~valid] == -1).all()
    real = p2e[:n_valid]
    assert torch.equal(e2p[real], torch.arange(n_valid))
    assert torch.equal(torch.sort(real).values, torch.nonzero(valid).flatten())
    # segments hold their expert's pairs, in expanded-index order (stable)
    for e in range(E):
        seg = p2e[offsets[e]:offsets[e + 1]]
        assert (flat[seg] == e).all()
        assert (seg.diff() > 0).all()
    # tiles: each segment covered exactly once by block_m-row tiles in expert order; the rest unused
    tile_expert, row_start = plan.tile_expert.long().cpu(), plan.tile_row_start.long().cpu()
    assert tile_expert.numel() == max_tiles(flat.numel(), E, bm)
    expected_e, expected_r = [], []
    for e in range(E):
        for start in range(int(offsets[e]), int(offsets[e + 1]), bm):
            expected_e.append(e)
            expected_r.append(start)
    used = len(expected_e)
    assert tile_expert[:used].tolist() == expected_e and row_start[:used].tolist() == expected_r
    assert (tile_expert[used:] == -1).all() and (row_start[used:] == -1).all()


@pytest.mark.parametrize(
    "M,K,E,block_m,invalid",
    [(1, 8, 256, 16, 0.0), (5, 2, 7, 16, 0.2), (37, 3, 11, 16, 0.1), (64, 6, 16, 32, 0.0), (120, 8, 64, 16, 0.05)],
)
def test_triton_matches_reference(M, K, E, block_m, invalid, gen, device):
    ids = random_ids(gen, M, K, E, invalid=invalid).to(device)
    ref = moe_dispatch(ids, E, block_m, backend="reference")
    assert_invariants(ref, ids)
    assert_same(moe_dispatch(ids, E, block_m, backend="triton"), ref)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("M,K,E", [(13, 5, 9), (50, 4, 33)])
def test_multi_chunk_path_matches_reference(M, K, E, chunk, gen, device):
    """The 3-kernel path (large batches) at small sizes: several chunks, a partial last one, -1 ids."""
    ids = random_ids(gen, M, K, E, invalid=0.1).to(device)
    ref = moe_dispatch_torch(ids, E, 16)
    outputs = [torch.full_like(getattr(ref, name), -7) for name in FIELDS]
    dispatch_triton(ids, E, 16, *outputs, chunk=chunk)
    assert_same(DispatchPlan(E, K, 16, *outputs), ref)



@pytest.mark.parametrize(
    "M,K,E,invalid",
    [(32, 8, 256, 0.1), (33, 8, 256, 0.1), (40, 8, 256, 0.0), (31, 8, 2048, 0.2), (100, 6, 2048, 0.05)],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_default_plans_around_one_program_max(M, K, E, invalid, dtype, gen, device):
    """N = 248/256 (one program, E a power of two: no bin for the overflow) and 264/320/600 (default chunks,
    a partial last one), at DeepSeek's E = 256 and at the largest E."""
    ids = random_ids(gen, M, K, E, invalid=invalid, dtype=dtype).to(device)
    ref = moe_dispatch(ids, E, 16, backend="reference")
    assert_invariants(ref, ids)
    assert_same(moe_dispatch(ids, E, 16, backend="triton"), ref)


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("M,block_m", [(200, 16), (300, 16), (300, 64)])
def test_skewed_routing(M, block_m, chunk, gen, device):
    """Most pairs on two experts: an expert spans many tiles, and in the chunked path many chunks' tile shares."""
    E, K = 8, 2
    ids = random_ids(gen, M, K, E, invalid=0.1)
    ids = torch.where(torch.rand(M, K, generator=gen) < 0.8, torch.tensor([[3, 6]], dtype=ids.dtype), ids).to(device)
    ref = moe_dispatch_torch(ids, E, block_m)
    assert_invariants(ref, ids)
    outputs = [torch.full_like(getattr(ref, name), -7) for name in FIELDS]
    dispatch_triton(ids, E, block_m, *outputs, chunk=chunk)
    assert_same(DispatchPlan(E, K, block_m, *outputs), ref)


def test_scan_over_more_chunks_than_one_step(gen, device):
    """More chunks than the scan over chunks takes in one step: its running totals carry across steps."""
    from moefuse.dispatch.kernel import SCAN_C

    M, K, E, chunk = SCAN_C * 2 + 9, 8, 5, 16  # N = (SCAN_C + 4.5) * chunk
    ids = random_ids(gen, M, K, E, invalid=0.1).to(device)
    ref = moe_dispatch_torch(ids, E, 16)
    outputs = [torch.full_like(getattr(ref, name), -7) for name in FIELDS]
    dispatch_triton(ids, E, 16, *outputs, chunk=chunk)
    assert_same(DispatchPlan(E, K, 16, *outputs), ref)

CURATED = [
    # (id, ids, E, block_m, why)
    ("empty-expert", [[0, 1], [1, 3], [3, 0]], 4, 16, "expert 2 gets no rows and no tile"),
    ("one-token", [[2, 0, 1]], 3, 16, "decode: M = 1"),
    ("fewer-than-tile", [[0, 1]] * 3 + [[1, 2]] * 20, 3, 16, "expert 0 has 3 rows, a partial tile"),
    ("exact-tile", [[0]] * 16 + [[1]] * 17, 2, 16, "16 rows are one tile, 17 rows two"),
    ("all-padded", [[-1, -1]] * 4, 5, 16, "every token padded: no rows, no tiles, all -1"),
    ("ids-ge-E", [[0, 5], [6, 1], [5, 0]], 5, 16, "fused shared slots / other rank's experts get no row"),
    ("mixed-invalid", [[-1, 2], [7, -1], [2, 2]], 3, 16, "-1 and >= E together; duplicates stay stable"),
    ("prime-E", [[e % 13, (3 * e + 1) % 13] for e in range(20)], 13, 16, "E not a power of two"),
    ("k1", [[e % 4] for e in range(9)], 4, 16, "top-1 routing"),
    ("k-eq-E", [list(range(4))[::-1]] * 6, 4, 16, "every token routed to every expert"),
    ("M0", torch.empty(0, 4, dtype=torch.int32), 8, 16, "empty batch: empty maps, zero offsets, no tiles"),
    ("tall-tile", [[e % 3, 3] for e in range(70)], 4, 64, "block_m 64: expert 3 spans two tiles"),
]


@pytest.mark.parametrize("ids,E,block_m,why", [c[1:] for c in CURATED], ids=[c[0] for c in CURATED])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_curated(ids, E, block_m, why, dtype, device):
    ids = torch.as_tensor(ids).to(dtype=dtype, device=device)
    ref = moe_dispatch(ids, E, block_m, backend="reference")
    assert_invariants(ref, ids)
    assert_same(moe_dispatch(ids, E, block_m, backend="triton"), ref)


def test_docstring_example():
    """The worked example in DispatchPlan's docstring (block_m = 2 is below the op's minimum: reference only)."""
    plan = moe_dispatch_torch(torch.tensor([[2, 0], [0, -1], [2, 0]]), 3, 2)
    assert plan.expert_offsets.tolist() == [0, 3, 3, 5]
    assert plan.permuted_to_expanded.tolist() == [1, 2, 5, 0, 4, -1]
    assert plan.expanded_to_permuted.tolist() == [3, 0, 1, -1, 4, 2]
    assert plan.tile_expert.tolist() == [0, 0, 2, -1, -1, -1]
    assert plan.tile_row_start.tolist() == [0, 2, 3, -1, -1, -1]


def test_plan_properties_and_custom_op(device):
    ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32, device=device)
    plan = moe_dispatch(ids, 3, 16)
    assert (plan.num_rows, plan.num_tokens) == (4, 2)
    assert hasattr(torch.ops.moefuse, "dispatch")


BAD = [
    # (id, kwargs, error, message fragment)
    ("ids-not-tensor", dict(topk_ids=[[0, 1]]), TypeError, "topk_ids"),
    ("ids-float", dict(topk_ids=torch.zeros(2, 2)), TypeError, "topk_ids"),
    ("ids-1d", dict(topk_ids=torch.zeros(4, dtype=torch.int32)), ValueError, "topk_ids"),
    ("ids-no-slots", dict(topk_ids=torch.zeros(3, 0, dtype=torch.int32)), ValueError, "topk_ids"),
    ("experts-zero", dict(num_experts=0), ValueError, "num_experts"),
    ("experts-bool", dict(num_experts=True), TypeError, "num_experts"),
    ("experts-too-many", dict(num_experts=4096), ValueError, "num_experts"),
    ("block-m-small", dict(block_m=8), ValueError, "block_m"),
    ("block-m-not-pow2", dict(block_m=48), ValueError, "block_m"),
    ("block-m-large", dict(block_m=512), ValueError, "block_m"),
    ("block-m-float", dict(block_m=16.0), TypeError, "block_m"),
    ("backend", dict(backend="cuda"), ValueError, "backend"),
]


@pytest.mark.parametrize("kwargs,error,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments(kwargs, error, fragment):
    args = dict(topk_ids=torch.zeros(2, 2, dtype=torch.int32), num_experts=4, block_m=16) | kwargs
    backend = args.pop("backend", "auto")
    with pytest.raises(error, match=fragment):
        moe_dispatch(**args, backend=backend)


def test_plan_checks_its_fields():
    plan = moe_dispatch_torch(torch.tensor([[0, 1]]), 2, 16)
    fields = {name: getattr(plan, name) for name in FIELDS}
    with pytest.raises(TypeError, match="tile_expert"):
        DispatchPlan(2, 2, 16, **(fields | {"tile_expert": fields["tile_expert"].long()}))
    with pytest.raises(ValueError, match="expert_offsets"):
        DispatchPlan(3, 2, 16, **fields)
    with pytest.raises(ValueError, match="top_k"):
        DispatchPlan(2, 0, 16, **fields)
