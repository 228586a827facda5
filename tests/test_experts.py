"""Experts: the Triton grouped GEMMs against the float64 reference, tile configs, and every error path."""

import json
import math

import pytest
import torch
from scripts_loader import script

from moefuse._runtime import GPU
from moefuse.dispatch import moe_dispatch
from moefuse.experts import GemmTiles, TileConfig, configs, moe_experts, moe_experts_torch, pick, pick_block_m
from moefuse.testing import assert_rel_close

E, H, I = 5, 48, 40  # tiny, not powers of two: partial column blocks and masked reduction steps
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
SMALL_TILES = TileConfig(16, GemmTiles(16, 16, 2, 4, 2), GemmTiles(16, 32, 3, 4, 2))  # 48 % 32: masked K


def make_inputs(gen, M, K, dtype, *, num_experts=E, hidden=H, width=I, invalid=0.0, scale=1.0):
    """Activations ~ N(0, scale), weights scaled so gate/up values are O(1) and the clamp bites."""
    x = (torch.randn(M, hidden, generator=gen) * scale).to(dtype)
    w1 = (torch.randn(num_experts, 2 * width, hidden, generator=gen) / math.sqrt(hidden)).to(dtype)
    w2 = (torch.randn(num_experts, hidden, width, generator=gen) / math.sqrt(width)).to(dtype)
    ids = torch.rand(M, num_experts, generator=gen).argsort(dim=1)[:, :K].int()
    ids = torch.where(torch.rand(M, K, generator=gen) < invalid, -1, ids)
    return x, w1, w2, ids


def check(x, w1, w2, ids, *, limit=None, block_m=16, device="cpu"):
    """Run dispatch + experts with the Triton backend and compare the real rows with the float64 oracle."""
    x, w1, w2, ids = (t.to(device) for t in (x, w1, w2, ids))
    plan = moe_dispatch(ids, w1.shape[0], block_m, backend="triton")
    out = torch.full((plan.num_rows, x.shape[1]), float("nan"), dtype=x.dtype, device=device)
    moe_experts(x, w1, w2, plan, swiglu_limit=limit, out=out, backend="triton")
    ref = moe_experts_torch(x, w1, w2, plan, swiglu_limit=limit, dtype=torch.float64,
                            out=torch.zeros(plan.num_rows, x.shape[1], dtype=torch.float64, device=device))
    n_valid = int(plan.expert_offsets[-1])
    assert_rel_close(out[:n_valid], ref[:n_valid], TOL[x.dtype], "gemm2_out")
    assert out[n_valid:].isnan().all(), "rows with no token must be left unwritten"
    return plan


@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-clamp", "clamp"])
@pytest.mark.parametrize("M", [0, 1, 7, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_float64(dtype, M, limit, gen, device):
    K = 2 + M % 2  # top-2 and top-3
    x, w1, w2, ids = make_inputs(gen, M, K, dtype, invalid=0.1, scale=2.0)
    check(x, w1, w2, ids, limit=limit, device=device)


def test_fp16(gen, device):
    check(*make_inputs(gen, 9, 2, torch.float16), device=device)


@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-clamp", "clamp"])
def test_nan_stays_in_its_token(limit, gen, device):
    """A NaN in one token's hidden state makes that token's rows NaN, as in the reference (the clamp must not turn
    it into the limit), and leaves every other row as it was."""
    x, w1, w2, ids = make_inputs(gen, 9, 2, torch.bfloat16, scale=2.0)
    x[4, 7] = float("nan")
    check(x, w1, w2, ids, limit=limit, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_small_tiles_several_per_expert(dtype, gen, device):
    """Forced 16-row tiles over ~20 rows per expert: experts span several tiles, GROUP_M > 1 interleaves them,
    16-wide column blocks leave a partial one (I = 40) and GEMM2's BLOCK_K = 32 masks its last step (I = 40)."""
    x, w1, w2, ids = make_inputs(gen, 33, 3, dtype, scale=2.0)
    with configs.override(SMALL_TILES):
        plan = check(x, w1, w2, ids, limit=1.5, device=device)
    tiles = plan.tile_expert[plan.tile_expert >= 0]
    assert tiles.unique(return_counts=True)[1].max() >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_groups_of_one_expert(dtype, gen, device):
    """GROUP_M = 0: each expert's tiles form a group (experts of 1 to 4 tiles, unused tiles after them); every
    (tile, column block) program must still run exactly once: any that did not would leave NaN rows."""
    x, w1, w2, _ = make_inputs(gen, 40, 3, dtype, scale=2.0)
    t = torch.arange(40)
    # expert 1: 40 rows (3 tiles of 16), expert 2: 10 (1), expert 3: 30 (2), expert 4: 5 (1), the rest -1
    ids = torch.stack([torch.ones(40), torch.where(t < 10, 2, 3), torch.where(t < 5, 4, -1)], dim=1).int()
    tiles = TileConfig(16, GemmTiles(16, 16, 0, 4, 2), GemmTiles(16, 32, 0, 4, 2))
    with configs.override(tiles):
        plan = check(x, w1, w2, ids, limit=1.5, device=device)
    assert plan.tile_expert.tolist()[:8] == [1, 1, 1, 2, 3, 3, 4, -1]


def test_block_m_32_and_wide_model(gen, device):
    """A taller plan tile and H, I > one column block, with the heuristic's tiles for those shapes."""
    x, w1, w2, ids = make_inputs(gen, 24, 3, torch.float32, num_experts=4, hidden=80, width=72)
    check(x, w1, w2, ids, block_m=32, device=device)


def test_strided_hidden_and_weights(gen, device):
    """Any strides: a column slice of a wider activation buffer and transposed-copy weights."""
    x, w1, w2, ids = make_inputs(gen, 7, 2, torch.float32)
    wide = torch.randn(7, H + 16, generator=gen)
    wide[:, 5:5 + H] = x
    w1_t = w1.transpose(1, 2).contiguous().transpose(1, 2)  # same values, H-major storage
    check(wide[:, 5:5 + H], w1_t, w2, ids, device=device)


@pytest.mark.parametrize("hidden", [48, 40], ids=["even-k", "ragged-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tall_tiles_take_their_short_tail(dtype, hidden, gen, device):
    """128-row tiles: an expert's last <= 64 rows ride on its previous tile (one weight read for up to 192 rows),
    an expert of at most 64 rows runs at half height, anything else at full height."""
    counts = [300, 193, 192, 129, 100, 50]  # 128 + (128 + 44); 128 + 65; 128 + 64; 128 + 1; one tile; half
    labels = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts))
    ids = labels.reshape(2, -1).T.contiguous()  # token t: experts labels[t] and labels[t + M], always distinct
    x, w1, w2, _ = make_inputs(gen, ids.shape[0], 2, dtype, num_experts=len(counts), hidden=hidden, scale=2.0)
    tiles = TileConfig(128, GemmTiles(16, 16, 2, 4, 2), GemmTiles(16, 32, 1, 4, 2))
    with configs.override(tiles):
        plan = check(x, w1, w2, ids, limit=1.5, block_m=128, device=device)
    assert plan.expert_offsets.diff().tolist() == counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden, width", [(32, 40), (256, 128)], ids=["narrow-pointers", "tma"])
def test_invariant_rows_have_the_bits_of_a_64_row_tile(dtype, hidden, width, gen, device):
    """``batch_invariant=True``: 16- and 32-row plans run both GEMMs swapped on wgmma (``bf16.swapped``), which gives
    each row the bits of a 64-row tile, with -1 slots, the clamp and a NaN token; a narrow GEMM2 (hidden 32: its tile
    choice asks for 32 columns, under wgmma's 64) as much as a wide one read through TMA. Without it the short tiles
    run mma.sync, whose bits differ on a GPU (the interpreter sums exactly: ``experts/bf16.py``)."""
    x, w1, w2, ids = (t.to(device) for t in make_inputs(gen, 24, 2, dtype, hidden=hidden, width=width, invalid=0.2))
    x[1, 7] = float("nan")
    ids[1] = torch.tensor([0, 3], dtype=ids.dtype)
    valid = (ids >= 0).flatten()

    def rows(block_m):
        plan = moe_dispatch(ids, E, block_m, backend="triton")
        out = moe_experts(x, w1, w2, plan, swiglu_limit=1.5, backend="triton", batch_invariant=True)
        return out[plan.expanded_to_permuted.long()[valid]]

    want = rows(64)
    assert want.isnan().any() and not want.isnan().all()  # the NaN token's rows, and the others finite
    for got in (rows(16), rows(32)):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_invariant_tiles_of_any_width_give_the_same_bits(dtype, gen, device):
    """A batch-invariant (swapped) tile's columns are its MMA's M, so its width orders no sum: GEMM1 on 64 or 128
    columns and 2 or 3 stages (``configs.one_wave`` narrows the slot layer's one-token tiles) gives every row the
    same bits, with -1 slots and the clamp."""
    x, w1, w2, ids = (t.to(device) for t in make_inputs(gen, 9, 2, dtype, hidden=256, width=256, invalid=0.2))
    plan = moe_dispatch(ids, w1.shape[0], 16, backend="triton")
    outs = []
    for columns, stages in ((128, 3), (64, 2), (64, 3)):
        tiles = TileConfig(16, GemmTiles(columns, 128, 1, 8, stages), GemmTiles(128, 128, 1, 4, 4))
        with configs.override(tiles):
            outs.append(moe_experts(x, w1, w2, plan, swiglu_limit=1.5, backend="triton", batch_invariant=True))
    n = int(plan.expert_offsets[-1])
    assert outs[0][:n].abs().sum() > 0
    for out in outs[1:]:
        assert torch.equal(out[:n], outs[0][:n])


def test_one_wave_narrows_a_short_second_wave():
    """``configs.one_wave``: 128-column programs that overflow one wave (one an SM by shared memory) become 64-column
    programs on the deepest pipeline at which all are resident at once; where no such pipeline exists, or the grid
    is one wave already, the tiles stay."""
    from moefuse._runtime import HOPPER

    slot = configs.heuristic(1, 257, 7168, 2048, 9, torch.bfloat16, gpu=HOPPER).gemm1  # 9 tiles: 144 programs
    assert (slot.block_n, slot.num_stages) == (64, 2)
    programs = 9 * 2048 // slot.block_n
    assert programs <= HOPPER.sms * configs.programs_per_sm(configs.smem_bytes(16, slot, 2, 2), HOPPER)
    wide = GemmTiles(128, 128, 1, 8, 3)
    assert configs.programs_per_sm(configs.smem_bytes(16, wide, 2, 2), HOPPER) == 1
    assert configs.one_wave(16, wide, 18, 2048, 2, 2, HOPPER) == wide  # 576 narrow programs fit no pipeline at once
    assert configs.one_wave(16, wide, 8, 2048, 2, 2, HOPPER) == wide  # 128 programs: one wave already
    assert configs.one_wave(16, GemmTiles(64, 128, 1, 8, 3), 9, 4096, 2, 2, HOPPER).block_n == 64


def test_slot_tiles_keep_a_tables_gemm1_in_one_wave():
    """``configs.slot_tiles``: the H100 table's one-token DeepSeek-V3 launch (128 columns, 3 stages: one program an
    SM) is tuned for the routed shape; with the shared expert as a slot it would be 144 programs on 132 SMs, so GEMM1
    narrows to one wave. Two tokens (18 tiles), tall tiles and fp8 (whose heuristic counts the slot) keep theirs."""
    from dataclasses import replace

    from moefuse._runtime import HOPPER

    h100 = replace(HOPPER, name="NVIDIA H100 80GB HBM3")
    assert configs.table_for(h100) is not None
    shape = (256, 7168, 2048, 8)

    def both(M, dtype=torch.bfloat16):
        E, H, I, K = shape
        routed = configs.pick(M, E, H, I, K, dtype, h100)
        return routed, configs.slot_tiles(routed, M, E, I, K, dtype, h100)

    routed, slot = both(1)
    assert (routed.gemm1.block_n, routed.gemm1.num_stages) == (128, 3)
    assert (slot.gemm1.block_n, slot.gemm1.num_stages) == (64, 2) and slot.gemm2 == routed.gemm2
    assert 9 * 2048 // 64 <= h100.sms * configs.programs_per_sm(configs.smem_bytes(16, slot.gemm1, 2, 2), h100)
    for M, dtype in ((2, torch.bfloat16), (4096, torch.bfloat16), (1, torch.float8_e4m3fn)):
        routed, slot = both(M, dtype)
        assert slot == routed


def test_swapped_tiles_are_64_columns_wide_and_fit():
    """A batch-invariant tile under 64 rows swaps its product: at least 64 columns (wgmma's M; narrower ones run
    mma.sync), as many of the tile choice's stages as then fit; 64-row tiles and fp32 keep their tiles."""
    from moefuse.experts import bf16

    narrow = GemmTiles(32, 256, 1, 4, 4)
    got = bf16.swapped(16, narrow, 2, 2)
    assert got is not None and got.block_n == 64 and got.block_k == 256
    wide = GemmTiles(64, 256, 1, 4, 4)  # the same launch 64 columns wide on all four stages: too large
    assert configs.smem_bytes(16, got, 2, 2) <= configs.SMEM_BUDGET < configs.smem_bytes(16, wide, 2, 2)
    assert bf16.swapped(32, GemmTiles(128, 64, 1, 4, 3), 1, 2) == GemmTiles(128, 64, 1, 4, 3)
    assert bf16.swapped(64, narrow, 2, 2) is None and bf16.swapped(16, narrow, 2, 4) is None


def test_weights_go_through_tma_only_where_it_can_read_them(device):
    """Contiguous weights get a descriptor; H-major storage or a misaligned base falls back to pointer loads.
    (The interpreter takes descriptors too, so CPU runs cover the same choice as Hopper.)"""
    from moefuse._runtime import capability, interpreting
    from moefuse.experts.common import weight_descriptor

    if not interpreting() and capability(device)[0] < 9:
        pytest.skip("TMA descriptors need a Hopper-class GPU (or the interpreter)")
    w = torch.zeros(3, 32, 64, dtype=torch.bfloat16, device=device)
    assert weight_descriptor(w, 16, 32) is not None
    assert weight_descriptor(w.transpose(1, 2).contiguous().transpose(1, 2), 16, 32) is None
    misaligned = torch.zeros(3 * 32 * 64 + 1, dtype=torch.bfloat16, device=device)[1:].view(3, 32, 64)
    assert weight_descriptor(misaligned, 16, 32) is None
    assert weight_descriptor(torch.zeros(3, 32, 72, dtype=torch.bfloat16, device=device)[:, :, :64], 16, 32) is not None


def test_reference_backend_and_default_out(gen, device):
    x, w1, w2, ids = (t.to(device) for t in make_inputs(gen, 7, 2, torch.float32))
    plan = moe_dispatch(ids, E, 16, backend="reference")
    got = moe_experts(x, w1, w2, plan, swiglu_limit=2, backend="reference")
    n_valid = int(plan.expert_offsets[-1])
    want = moe_experts_torch(x, w1, w2, plan, swiglu_limit=2)
    assert got.shape == (14, H) and got.dtype == torch.float32
    assert torch.equal(got[:n_valid], want[:n_valid])


def test_clamp_is_applied(device):
    """One token, one expert, weights that make gate = 30 and up = -30: with limit 10 the result is
    SiLU(10) * (-10) times the down weight; without it SiLU(30) * (-30)."""
    x = torch.ones(1, 16, device=device)
    w1 = torch.zeros(1, 32, 16, device=device)
    w1[0, 0, :] = 30 / 16  # gate column 0
    w1[0, 16, :] = -30 / 16  # up column 0
    w2 = torch.zeros(1, 16, 16, device=device)
    w2[0, :, 0] = 1.0
    plan = moe_dispatch(torch.zeros(1, 1, dtype=torch.int32, device=device), 1, 16, backend="triton")
    for limit, gate, up in [(10.0, 10.0, -10.0), (None, 30.0, -30.0)]:
        out = moe_experts(x, w1, w2, plan, swiglu_limit=limit, backend="triton")
        expected = gate / (1 + math.exp(-gate)) * up
        assert torch.allclose(out, torch.full_like(out, expected), rtol=1e-6)


def test_dispatch_and_experts_compile_fullgraph(gen, device):
    """Both custom ops (and the tile choice) trace into one torch.compile graph with no graph break."""
    x, w1, w2, ids = (t.to(device) for t in make_inputs(gen, 7, 2, torch.float32))

    def step(x, ids):
        plan = moe_dispatch(ids, E, 16, backend="triton")
        return moe_experts(x, w1, w2, plan, swiglu_limit=3.0, backend="triton"), plan.expert_offsets

    got, offsets = torch.compile(step, fullgraph=True)(x, ids)
    want, want_offsets = step(x, ids)
    n_valid = int(want_offsets[-1])
    assert torch.equal(offsets, want_offsets) and torch.equal(got[:n_valid], want[:n_valid])


# --- tile configs ---------------------------------------------------------------------------------------

H100 = GPU("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)
H200 = GPU("NVIDIA H200", (9, 0), 132, 232448)
H100_PCIE = GPU("NVIDIA H100 PCIe", (9, 0), 114, 232448)  # no tuned table: its SM count differs
A100 = GPU("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
L40S = GPU("NVIDIA L40S", (8, 9), 142, 101376)
B200 = GPU("NVIDIA B200", (10, 0), 148, 232448)
SHAPES = {(256, 7168, 2048, 8), (384, 7168, 2048, 8), (256, 4096, 2048, 6), (128, 2048, 768, 8),
          (128, 4096, 1408, 8)}  # the five SPEC models' (E, H, I, K)
TILE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8}


@pytest.mark.parametrize("gpu, name", [(H100, "h100"), (H200, "h200"), (H100_PCIE, None), (A100, None),
                                       (B200, None), ((9, 0), None), (None, None)])
def test_each_gpu_model_reads_its_own_table(gpu, name):
    """A table serves the GPU model it was tuned on (its name in the device's and the same SM count); any other GPU,
    a bare capability and no GPU get the heuristic."""
    assert configs.table_for(gpu) == name


@pytest.mark.parametrize("name, gpu", [("h100", H100), ("h200", H200)])
def test_pick_reads_the_table(name, gpu):
    table = configs.load_table(configs.TABLES[name])
    for entry in table["entries"]:
        fmt = entry.get("format", "bf16")
        dtype = TILE_DTYPES[fmt]
        shape = (entry["E"], entry["H"], entry["I"], entry["K"])
        buckets = [int(m) for m in entry["buckets"]]
        for M in (1, 2, 16, 100, 640, 768, 1024, 3000, 4096, 10000):
            data = entry["buckets"][str(configs.nearest_bucket(buckets, M))]
            got = pick(M, *shape, dtype, gpu)
            if fmt == "bf16":
                assert got == TileConfig.from_dict(data), (name, shape, M)
            else:  # a tile height; the rest as the heuristic launches it
                assert got == configs.heuristic(M, *shape, dtype, block_m=data["block_m"], gpu=gpu), (name, shape, M)
            assert pick_block_m(M, *shape, dtype, gpu) == got.block_m


def test_tables_are_valid():
    """Every shipped config parses and is not ruled out by Hopper's shared memory; the H100 table covers the five SPEC
    models in every format, densely (every 32 tokens up to 1,024), the H200 table their 16-bit experts.

    (``test_sm90.py`` compiles each for sm_90 and checks the shared memory the compiler allocates.)"""
    for name, path in configs.TABLES.items():
        table = configs.load_table(path)
        assert set(table["gpu"]) == {"name", "sms", "capability"}
        formats = {(e.get("format", "bf16"), e["E"], e["H"], e["I"], e["K"]) for e in table["entries"]}
        wanted = {("bf16", *shape) for shape in SHAPES}
        if name == "h100":
            wanted |= {(fmt, *shape) for shape in SHAPES for fmt in ("fp8", "mxfp4")}
        assert wanted <= formats, name
        for entry in table["entries"]:
            fmt = entry.get("format", "bf16")
            if name == "h100":
                assert {32 * i for i in range(1, 33)} <= {int(m) for m in entry["buckets"]}, entry["model"]
            for bucket, data in entry["buckets"].items():
                assert int(bucket) >= 1
                if fmt != "bf16":
                    assert data["block_m"] in (16, 32, 64, 128) and (fmt != "fp8" or data["block_m"] != 32)
                    continue
                cfg = TileConfig.from_dict(data)
                assert configs.weight_buffer_bytes(cfg.gemm1, 2, 2) <= configs.HOPPER_SMEM
                assert configs.weight_buffer_bytes(cfg.gemm2, 1, 2) <= configs.HOPPER_SMEM


@pytest.mark.parametrize("gpu", [A100, L40S, B200, H100_PCIE], ids=lambda g: g.name)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_untuned_gpus_get_tiles_that_fit_them(gpu, fmt):
    """A GPU without a table gets the heuristic, sized to its shared memory and SM count: the operand buffers the
    model counts fit under its opt-in limit, and the decode tiles spread over its SMs."""
    dtype = TILE_DTYPES[fmt]
    for shape in SHAPES:
        for M in (1, 16, 128, 1024, 4096):
            cfg = pick(M, *shape, dtype, gpu)
            assert cfg == configs.heuristic(M, *shape, dtype, gpu=gpu)
            element = 1 if fmt != "bf16" else 2
            for tiles, operands in ((cfg.gemm1, 2), (cfg.gemm2, 1)):
                assert configs.smem_bytes(cfg.block_m, tiles, operands, element) <= gpu.smem, (shape, M, tiles)


def test_heuristic_without_arch_and_forced_block_m():
    decode = pick(1, 256, 7168, 2048, 8, torch.bfloat16, None)
    prefill = pick(4096, 256, 7168, 2048, 8, torch.bfloat16, None)
    assert decode.block_m == 16 and decode.gemm1.block_k == 128 and decode.gemm2.num_warps == 4
    assert prefill.block_m == 128 and prefill.gemm1.num_warps == 8
    assert pick(4096, 256, 7168, 2048, 8, torch.bfloat16, (9, 0), block_m=32).block_m == 32
    tiny = pick(7, E, H, I, 2, torch.float32, None)
    assert tiny.gemm1.block_n <= 64 and tiny.gemm1.block_k <= 64  # capped by the tiny dims


def test_fp8_tall_decode_stages_follow_the_gemm1_waves():
    """fp8 64-row GEMM1 on a few rows (a plan forced to 64 rows at decode): 5 stages where its programs (tiles x
    128-column blocks) fit the SMs once, 2 where they need up to two an SM (two share one: DeepSeek-V3's token with
    its shared slot on 64-row tiles, 9 x 16 = 144 programs on 132 SMs, 179.3 -> 170.2 us on an H100), 4 beyond."""
    fp8 = torch.float8_e4m3fn
    stages = {tiles: configs.heuristic(1, 256, 7168, 2048, tiles, fp8, block_m=64).gemm1.num_stages
              for tiles in (8, 9, 16, 17)}  # one tile per routed expert (and the slot) at one token
    assert stages == {8: 5, 9: 2, 16: 2, 17: 4}, stages
    assert configs.heuristic(1, 256, 7168, 2048, 9, fp8, block_m=16).gemm1.num_stages == configs.FP8_PAIR_STAGES


def test_mxfp4_tile_heights_follow_the_measured_limits():
    """MXFP4 (uint8) tiles by rows per touched expert (``configs.MXFP4_HEIGHTS``): each height up to its limit, the
    next one row past it, 128 beyond the last (DeepSeek-V4-Flash: E 256, top-6, so M tokens are 6M/256 rows an
    expert)."""
    for height, most in configs.MXFP4_HEIGHTS:
        for rows, want in ((most, height), (most + 1, 2 * height)):
            M = rows * 256 // 6  # the largest M whose rows per expert, rounded up, is ``rows``
            assert -(-M * 6 // 256) == rows
            assert pick_block_m(M, 256, 4096, 2048, 6, torch.uint8, (9, 0)) == want, (M, rows)
    assert pick_block_m(4096, 256, 4096, 2048, 6, torch.uint8, (9, 0)) == 128
    assert pick_block_m(1, 256, 4096, 2048, 6, torch.uint8, None) == 16


def test_override_is_scoped():
    default = pick(7, E, H, I, 2, torch.float32, None)
    with configs.override(SMALL_TILES):
        assert pick(7, E, H, I, 2, torch.float32, None) == SMALL_TILES
        assert pick(7, E, H, I, 2, torch.float32, None, block_m=32).block_m == 32
        with pytest.raises(RuntimeError):
            with configs.override(TileConfig(32, SMALL_TILES.gemm1, SMALL_TILES.gemm2)):
                assert pick_block_m(7, E, H, I, 2, torch.float32, None) == 32
                raise RuntimeError
        assert pick(7, E, H, I, 2, torch.float32, None) == SMALL_TILES
    assert pick(7, E, H, I, 2, torch.float32, None) == default
    with pytest.raises(TypeError, match="config"):
        with configs.override({"block_m": 16}):
            pass


@pytest.mark.parametrize("bad", [dict(block_n=24), dict(block_k=8), dict(num_warps=3), dict(group_m=-1),
                                 dict(num_stages=0)])
def test_gemm_tiles_checks(bad):
    args = dict(block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=2) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        GemmTiles(**args)


def test_tuner_and_benchmark_import_on_cpu():
    import moefuse.bench.experts as bench

    assert callable(bench.check) and callable(bench.run) and callable(bench.main)
    assert callable(script("tune_experts").main)


def test_dense_tuning_takes_the_tallest_tile_within_two_percent():
    """``tune_experts --dense``: a taller tile within ``TALLER_WITHIN`` of the fastest wins (a skewed router runs a
    short tile twice for its busiest experts), one further off does not; the status names the routing measured."""
    tune = script("tune_experts")
    short = configs.heuristic(384, 256, 7168, 2048, 8, torch.bfloat16, block_m=16)
    tall = configs.heuristic(384, 256, 7168, 2048, 8, torch.bfloat16, block_m=32)

    def rows(tall_us: float, routing: str) -> list[dict]:
        return [{"model": "deepseek-v3", "format": "bf16", "M": M, "cand": cand, "block_m": cfg.block_m,
                 "config": cfg.to_dict(), "persist": False, "us": us, "routing": routing}
                for M in (352, 384, 416) for cand, cfg, us in (("h16", short, 100.0), ("h32", tall, tall_us))]

    (near,) = tune.dense_entries(rows(101.9, "layer"), "an H100", "2026-12-06")
    assert {bucket["block_m"] for bucket in near["buckets"].values()} == {32}
    assert "the layer's own routing" in near["status"] and "2026-12-06" in near["status"]
    (far,) = tune.dense_entries(rows(102.1, "uniform"), "an H100", "2026-12-06")
    assert {bucket["block_m"] for bucket in far["buckets"].values()} == {16}
    assert "uniform random routing" in far["status"]
    assert [row["us"] for row in tune.dense_choice_times(rows(101.9, "layer"))] == [101.9] * 3


def test_dense_tuning_over_part_of_the_grid_keeps_the_other_buckets():
    """``tune_experts --dense --tokens ...``: the buckets the run measured replace the table's over that range; the
    table's buckets outside it stay, and the status says which measurement each range comes from."""
    tune = script("tune_experts")
    old = {"model": "deepseek-v3", "format": "mxfp4", "E": 256, "H": 7168, "I": 2048, "K": 8, "status": "before",
           "buckets": {str(m): {"block_m": h} for m, h in ((1, 16), (256, 16), (400, 16), (512, 32), (2048, 128))}}
    new = {**{k: v for k, v in old.items() if k != "buckets"}, "status": "retuned",
           "buckets": {"256": {"block_m": 16}, "384": {"block_m": 32}, "512": {"block_m": 32}}}
    other = {**new, "H": 4096, "buckets": {"1": {"block_m": 16}}}
    table = {"entries": [json.loads(json.dumps(old))]}
    tune.merge_entries(table, [json.loads(json.dumps(new)), other])
    merged, added = table["entries"]
    assert merged["buckets"] == {"1": {"block_m": 16}, "256": {"block_m": 16}, "384": {"block_m": 32},
                                 "512": {"block_m": 32}, "2048": {"block_m": 128}}  # 400 was inside 256-512
    assert merged["status"] == "retuned; buckets outside 256-512 tokens: before"
    assert added == other
    whole = {**new, "buckets": {str(m): {"block_m": 16} for m in (1, 4096)}}
    tune.merge_entries(table, [whole])
    assert table["entries"][0] == whole  # a run over the whole range replaces the entry


def test_dense_tuning_times_each_candidate_in_alternating_passes():
    """``tune_experts --dense --passes N``: every candidate timed N times, the passes walking the candidates forwards
    then backwards (a clock drift under the power cap does not follow their order); a candidate whose launch raises
    is logged once and left out, not retried."""
    tune = script("tune_experts")
    order: list[str] = []

    def call(name: str):
        def run() -> str:
            if name == "bad":
                raise RuntimeError("out of resources")
            return name
        return run

    def timer(fn) -> float:
        order.append(fn())
        return float(len(order))

    calls = [call("a"), call("bad"), call("b")]
    times = tune.time_passes(calls, 3, timer, lambda i: f"candidate {i}")
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert times == [[1.0, 4.0, 5.0], [], [2.0, 3.0, 6.0]]


# --- errors ---------------------------------------------------------------------------------------------

def _good_args():
    gen = torch.Generator().manual_seed(0)
    x, w1, w2, ids = make_inputs(gen, 3, 2, torch.float32)
    return dict(hidden=x, gate_up_proj=w1, down_proj=w2, plan=moe_dispatch(ids, E, 16, backend="reference"))


BAD = [
    # (id, change, error, message fragment)
    ("hidden-not-tensor", lambda a: dict(hidden=a["hidden"].tolist()), TypeError, "hidden"),
    ("hidden-int", lambda a: dict(hidden=a["hidden"].int()), TypeError, "hidden"),
    ("hidden-3d", lambda a: dict(hidden=a["hidden"][None]), ValueError, "hidden"),
    ("hidden-no-columns", lambda a: dict(hidden=a["hidden"][:, :0], gate_up_proj=a["gate_up_proj"][:, :, :0],
                                         down_proj=a["down_proj"][:, :0]), ValueError, "hidden"),
    ("weights-dtype", lambda a: dict(gate_up_proj=a["gate_up_proj"].double()), TypeError, "gate_up_proj"),
    ("gate-up-odd", lambda a: dict(gate_up_proj=a["gate_up_proj"][:, 1:]), ValueError, "gate_up_proj"),
    ("gate-up-H", lambda a: dict(gate_up_proj=a["gate_up_proj"][:, :, 1:]), ValueError, "gate_up_proj"),
    ("gate-up-2d", lambda a: dict(gate_up_proj=a["gate_up_proj"][0]), ValueError, "gate_up_proj"),
    ("down-shape", lambda a: dict(down_proj=a["down_proj"][:, :, 1:]), ValueError, "down_proj"),
    ("down-dtype", lambda a: dict(down_proj=a["down_proj"].bfloat16()), TypeError, "down_proj"),
    ("down-device", lambda a: dict(down_proj=a["down_proj"].to("meta")), ValueError, "down_proj"),
    ("plan-type", lambda a: dict(plan=a["plan"].expert_offsets), TypeError, "plan"),
    ("plan-experts", lambda a: dict(gate_up_proj=a["gate_up_proj"][:4], down_proj=a["down_proj"][:4]),
     ValueError, "plan"),
    ("plan-rows", lambda a: dict(hidden=a["hidden"][:2]), ValueError, "plan"),
    ("limit-zero", lambda a: dict(swiglu_limit=0.0), ValueError, "swiglu_limit"),
    ("limit-negative", lambda a: dict(swiglu_limit=-1), ValueError, "swiglu_limit"),
    ("limit-inf", lambda a: dict(swiglu_limit=float("inf")), ValueError, "swiglu_limit"),
    ("limit-nan", lambda a: dict(swiglu_limit=float("nan")), ValueError, "swiglu_limit"),
    ("limit-str", lambda a: dict(swiglu_limit="10"), TypeError, "swiglu_limit"),
    ("limit-bool", lambda a: dict(swiglu_limit=True), TypeError, "swiglu_limit"),
    ("out-shape", lambda a: dict(out=torch.empty(5, H)), ValueError, "out"),
    ("out-dtype", lambda a: dict(out=torch.empty(6, H, dtype=torch.bfloat16)), TypeError, "out"),
    ("out-overlap", lambda a: dict(out=torch.empty(1, H).expand(6, H)), ValueError, "out"),
    ("backend", lambda a: dict(backend="gpu"), ValueError, "backend"),
]


@pytest.mark.parametrize("change,error,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments(change, error, fragment):
    args = _good_args()
    args |= change(args)
    plan = args.pop("plan")
    with pytest.raises(error, match=fragment):
        moe_experts(args.pop("hidden"), args.pop("gate_up_proj"), args.pop("down_proj"), plan, **args)
