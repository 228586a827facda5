"""Deferred finalize (SPEC §3): the context switch, the deferred output record, and the fused finalize."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import threading

import pytest
import torch

from moefuse import _runtime
from moefuse.finalize import (
    DeferredFinalizeOutput,
    deferred_finalize_allowed,
    deferred_finalize_context,
    deferred_finalize_enabled,
    finalize_deferred_output,
    moe_finalize_fuse_shared,
    moe_finalize_fuse_shared_torch,
)
from moefuse.testing import max_ulp_distance


def test_context_nests_and_restores():
    assert not deferred_finalize_enabled()
    with deferred_finalize_context():
        assert deferred_finalize_enabled()
        with deferred_finalize_context(enabled=False):  # a caller can opt one region out
            assert not deferred_finalize_enabled()
            with deferred_finalize_context():
                assert deferred_finalize_enabled()
            assert not deferred_finalize_enabled()
        assert deferred_finalize_enabled()
    assert not deferred_finalize_enabled()


def test_context_restores_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with deferred_finalize_context():
            raise RuntimeError("boom")
    assert not deferred_finalize_enabled()


def test_context_rejects_non_bool():
    with pytest.raises(TypeError, match="enabled"):
        with deferred_finalize_context(enabled="yes"):
            pass


def test_threads_do_not_inherit_unless_copied():
    seen = {}

    def probe(key):
        seen[key] = deferred_finalize_enabled()

    with deferred_finalize_context():
        plain = threading.Thread(target=probe, args=("plain",))
        copied = threading.Thread(target=contextvars.copy_context().run, args=(probe, "copied"))
        plain.start(), copied.start()
        plain.join(), copied.join()
    assert seen == {"plain": False, "copied": True}


def test_threads_inside_their_own_context_do_not_leak():
    # Two threads flip the switch concurrently; each sees only its own value at every step.
    barrier = threading.Barrier(2)
    errors = []

    def worker(enabled):
        with deferred_finalize_context(enabled):
            for _ in range(50):
                barrier.wait()
                if deferred_finalize_enabled() is not enabled:
                    errors.append(enabled)
        barrier.wait()
        if deferred_finalize_enabled():
            errors.append("leaked")

    threads = [threading.Thread(target=worker, args=(flag,)) for flag in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_asyncio_tasks_are_isolated():
    async def task(enabled, mine_set, other_set):
        with deferred_finalize_context(enabled):
            mine_set.set()
            await other_set.wait()  # the other task is now inside its own context too
            for _ in range(10):
                await asyncio.sleep(0)
                assert deferred_finalize_enabled() is enabled
        return deferred_finalize_enabled()

    async def main():
        a_set, b_set = asyncio.Event(), asyncio.Event()
        results = await asyncio.gather(task(True, a_set, b_set), task(False, b_set, a_set))
        assert results == [False, False]
        with deferred_finalize_context():
            early = asyncio.create_task(_read_flag())
        # The task first runs after the block has exited, but it copied the context when it was created.
        assert await early is True
        assert deferred_finalize_enabled() is False

    asyncio.run(main())


async def _read_flag():
    return deferred_finalize_enabled()


@pytest.mark.parametrize(("value", "allowed"), [(None, True), ("1", True), ("0", False), (" 0 ", False), ("", True)])
def test_environment_sets_the_default_once(monkeypatch, value, allowed):
    """``MOEFUSE_ENABLE_DEFERRED_FINALIZE`` is the process default, read at import (``_runtime.read_environment``);
    changing the environment later changes nothing, ``set_defaults`` does."""
    environ = {} if value is None else {"MOEFUSE_ENABLE_DEFERRED_FINALIZE": value}
    monkeypatch.setattr(_runtime, "DEFAULTS", _runtime.read_environment(environ))
    assert deferred_finalize_allowed() is allowed
    monkeypatch.setenv("MOEFUSE_ENABLE_DEFERRED_FINALIZE", "1" if not allowed else "0")
    assert deferred_finalize_allowed() is allowed
    with _runtime.defaults(deferred_finalize=not allowed):
        assert deferred_finalize_allowed() is (not allowed)
    assert deferred_finalize_allowed() is allowed


def make_deferred(gen, device, *, num_tokens=5, top_k=6, hidden=96, dtype=torch.bfloat16):
    """A deferred experts result (rows in random order, some slots -1, two padding rows) and a shared output."""
    num_rows = num_tokens * top_k + 2
    rows = torch.randperm(num_rows, generator=gen)[: num_tokens * top_k].int()
    rows[torch.rand(rows.shape, generator=gen) < 0.2] = -1
    deferred = DeferredFinalizeOutput(
        gemm2_out=torch.randn(num_rows, hidden, generator=gen).to(dtype).to(device),
        expert_weights=torch.rand(num_tokens, top_k, generator=gen).to(device),
        expanded_idx_to_permuted_idx=rows.to(device),
        top_k=top_k,
    )
    return deferred, torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)


def test_output_record_is_frozen(gen, device):
    deferred, _ = make_deferred(gen, device)
    with pytest.raises(dataclasses.FrozenInstanceError):
        deferred.top_k = 2


BAD_RECORDS = {
    # Each field is checked at construction, so a broken runner fails where the bug is, not at finalize.
    "gemm2_out-int": (dict(gemm2_out=torch.zeros(12, 4, dtype=torch.int32)), TypeError, "gemm2_out"),
    "gemm2_out-1d": (dict(gemm2_out=torch.zeros(12)), ValueError, "gemm2_out"),
    "weights-fp16": (dict(expert_weights=torch.zeros(3, 2, dtype=torch.float16)), TypeError, "expert_weights"),
    "weights-top_k": (dict(expert_weights=torch.zeros(3, 3)), ValueError, "expert_weights"),
    "weights-device": (dict(expert_weights=torch.zeros(3, 2, device="meta")), ValueError, "expert_weights"),
    "idx-int64": (
        dict(expanded_idx_to_permuted_idx=torch.zeros(6, dtype=torch.int64)),
        TypeError,
        "expanded_idx_to_permuted_idx",
    ),
    "idx-length": (
        dict(expanded_idx_to_permuted_idx=torch.zeros(5, dtype=torch.int32)),
        ValueError,
        "expanded_idx_to_permuted_idx",
    ),
    "top_k-zero": (dict(top_k=0), ValueError, "top_k"),
}


@pytest.mark.parametrize("case", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
def test_output_record_checks_fields(case):
    changes, error, name = case
    fields = dict(
        gemm2_out=torch.zeros(6, 4),
        expert_weights=torch.zeros(3, 2),
        expanded_idx_to_permuted_idx=torch.zeros(6, dtype=torch.int32),
        top_k=2,
    )
    with pytest.raises(error, match=name):
        DeferredFinalizeOutput(**{**fields, **changes})


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_finalize_deferred_equals_the_op(gen, device, backend):
    deferred, shared_output = make_deferred(gen, device)
    direct = moe_finalize_fuse_shared(
        deferred.gemm2_out,
        deferred.expanded_idx_to_permuted_idx,
        deferred.expert_weights,
        shared_output,
        deferred.top_k,
        backend=backend,
    )
    assert torch.equal(finalize_deferred_output(deferred, shared_output, backend=backend), direct)
    out = torch.empty_like(shared_output)
    assert finalize_deferred_output(deferred, shared_output, out=out, backend=backend) is out
    assert torch.equal(out, direct)


def test_finalize_deferred_without_shared_output(gen, device):
    deferred, _ = make_deferred(gen, device)
    combined = finalize_deferred_output(deferred, None, backend="triton")
    fields = (deferred.gemm2_out, deferred.expanded_idx_to_permuted_idx, deferred.expert_weights, None, deferred.top_k)
    if _runtime.interpreting():
        assert max_ulp_distance(combined, moe_finalize_fuse_shared_torch(*fields)) == 0
    # On the GPU the kernel's FMAs may round the fp32 sum differently from torch's, and where the slots cancel
    # that moves the bf16 result by more than an ulp: bound it against the exact sum instead, one bf16 rounding
    # plus fp32 accumulation error on the scale of sum |w x|.
    exact, scale = (
        moe_finalize_fuse_shared_torch(
            gemm2_out, deferred.expanded_idx_to_permuted_idx, weights, None, deferred.top_k,
            out=torch.empty_like(combined, dtype=torch.float64), dtype=torch.float64,
        )
        for gemm2_out, weights in ((deferred.gemm2_out, deferred.expert_weights),
                                   (deferred.gemm2_out.abs(), deferred.expert_weights.abs()))
    )
    bound = torch.finfo(torch.bfloat16).eps / 2 * exact.abs() + deferred.top_k * 2.0**-23 * scale
    assert bool(((combined.double() - exact).abs() <= bound).all())


def test_finalize_deferred_rejects_other_types():
    with pytest.raises(TypeError, match="deferred"):
        finalize_deferred_output((torch.zeros(2, 2),), None)


def test_deferred_matches_unfused_path_up_to_one_rounding(gen, device):
    # Non-deferred path: combine (rounded to bf16), then a separate add (rounded again). The fused path rounds
    # once, so the two differ by at most the combine's rounding plus one output rounding, and the fused result
    # is the more accurate of the two.
    deferred, shared_output = make_deferred(gen, device, num_tokens=32, hidden=256)
    fused = finalize_deferred_output(deferred, shared_output, backend="triton")
    combined = finalize_deferred_output(deferred, None, backend="triton")
    unfused = torch.add(combined, shared_output)
    fields = (deferred.gemm2_out, deferred.expanded_idx_to_permuted_idx, deferred.expert_weights)
    exact_sum, exact = (
        moe_finalize_fuse_shared_torch(
            *fields, shared, deferred.top_k, out=torch.empty_like(combined, dtype=torch.float64), dtype=torch.float64
        )
        for shared in (None, shared_output)
    )
    # |round(S) - S| <= eps|S|/2 and each output rounding <= eps|out|/2 (ulp(x) <= eps|x|); the slack covers
    # the fp32 accumulation and the second-order terms.
    finfo = torch.finfo(torch.bfloat16)
    bound = finfo.eps * (exact_sum.abs() + exact.abs()) + finfo.tiny
    assert bool(((fused.double() - unfused.double()).abs() <= bound).all())
    error = lambda t: (t.double() - exact).norm().item()  # noqa: E731
    assert error(fused) <= error(unfused)
