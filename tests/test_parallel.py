"""The sharded layer on torch.distributed (gloo, spawned CPU processes) against the single-process MoELayer.

Each spawned world runs every mode (EP with replicated tokens, expert TP, EP with all-to-all in both variants) on a
DeepSeek-V3-shaped and a Qwen3-shaped small config in fp32, plus the edge cases: a rank with no tokens, tokens
whose experts all live on another rank, padded tokens, shapes that do not split, a capacity that is too small; and
with ``batch_invariant=True`` a token's bits alone and in batches, in every mode (under the interpreter only).
"""

from __future__ import annotations

import glob

import parallel_worker
import pytest
import torch
import torch.multiprocessing as mp


@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_matches_the_full_layer(world, tmp_path):
    errors = str(tmp_path / "errors")
    mp.spawn(parallel_worker.worker, args=(world, str(tmp_path / "init"), errors), nprocs=world, join=True)
    reports = [open(path).read() for path in sorted(glob.glob(errors + ".*"))]
    assert not reports, "\n\n".join(reports)


def test_needs_an_initialised_group():
    from moefuse import MoEConfig
    from moefuse.parallel import ShardedMoELayer

    with pytest.raises(ValueError, match="init_process_group"):
        ShardedMoELayer(MoEConfig(hidden_size=8, intermediate_size=4, num_experts=2, top_k=1), "ep",
                        dtype=torch.float32)
