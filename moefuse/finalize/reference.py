"""Readable PyTorch version of the finalize stage (SPEC §2): the spec you can run, the CPU path, the test oracle.

For token ``t`` with ``top_k`` slots (its routed choices, in the router's order), slot ``k`` lives in row
``expanded_idx_to_permuted_idx[t * top_k + k]`` of ``gemm2_out`` (or nowhere, when that entry is -1):

    out[t, :] = round( sum_{k: row != -1} float(w[t, k]) * float(gemm2_out[row, :H]) + float(shared[t, :]) )

accumulated in ``dtype`` in slot order k = 0..top_k-1, rounded once at the end.
"""

from __future__ import annotations

import torch


def moe_finalize_fuse_shared_torch(
    gemm2_out: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    expert_weights: torch.Tensor,
    shared_output: torch.Tensor | None,
    top_k: int,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Combine each token's expert rows with its routing weights, add the shared-expert output, round once.

    Args:
        gemm2_out: [R, Hp] expert outputs, one row per (token, slot) pair in any order; padding rows and
            padding columns (beyond H) are never read.
        expanded_idx_to_permuted_idx: [M * top_k] integer; entry ``t * top_k + k`` is the row of slot k of token
            t, or -1 when the slot has no row. Entries outside [-1, R) are treated as absent here, so this
            function never indexes out of bounds; the public op rejects them where checking is on.
        expert_weights: [M, top_k] routing weights (scaling factor already applied).
        shared_output: [M, H] with H <= Hp, or None (then H = Hp).
        top_k: slots per token.
        out: where to write [M, H]; its dtype is the one result rounding (any float dtype, so a float64 ``out``
            keeps the exact sum). Default: a new tensor of gemm2_out's dtype.
        dtype: accumulation dtype. float32 is the contract; float64 makes this the test oracle.

    Returns:
        ``out``. Any device: this is the CPU path and the oracle, not a fast path.
    """
    num_rows, padded_h = gemm2_out.shape
    num_tokens = expert_weights.shape[0]
    hidden = shared_output.shape[1] if shared_output is not None else padded_h
    rows = expanded_idx_to_permuted_idx.reshape(num_tokens, top_k).long()
    present = (rows >= 0) & (rows < num_rows)
    acc = torch.zeros(num_tokens, hidden, dtype=dtype, device=gemm2_out.device)
    for k in range(top_k):  # slot order is part of the contract: floating-point sums depend on it
        if num_rows == 0:  # no expert row exists, so every slot is absent
            break
        # Absent slots gather row 0 (always in bounds) and are then dropped by the `where`, so a NaN or inf in
        # row 0 or in an absent slot's weight cannot leak into the sum.
        values = gemm2_out[rows[:, k].clamp(0, num_rows - 1), :hidden].to(dtype)
        term = expert_weights[:, k].to(dtype)[:, None] * values
        acc = torch.where(present[:, k, None], acc + term, acc)
    if shared_output is not None:
        acc = acc + shared_output.to(dtype)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=gemm2_out.dtype, device=gemm2_out.device)
    return out.copy_(acc)
