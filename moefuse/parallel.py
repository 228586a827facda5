"""The MoE layer sharded over a torch.distributed process group: expert parallel and tensor parallel.

``ShardedMoELayer.from_layer(layer, mode, group)`` keeps this rank's shard of a full :class:`moefuse.MoELayer`
(every rank builds or loads the full layer, e.g. on the CPU, and keeps only its part on its device). The
transport is torch.distributed's (NCCL on GPUs, gloo on CPUs); the stages are moefuse's own ops. Modes, with W
ranks, E experts, H the model width and 2-byte activations (``docs/PARALLEL.md`` has the costs and when to
pick which):

- ``"ep"``, expert parallel, tokens replicated (attention tensor-parallel): rank r owns experts
  ``[r·E/W, (r+1)·E/W)``. Every rank routes the same tokens; slots (a token's routed choices, ``ids[t, k]``) of
  experts elsewhere become -1 (dispatch skips them); one fused finalize adds this rank's weighted rows and its
  part of the shared expert; one all-reduce (``scatter_output=True``: a reduce-scatter, each rank keeping ``M/W``
  rows).
- ``"tp"``, expert tensor parallel, tokens replicated: every rank holds columns ``[r·I/W, (r+1)·I/W)`` of every
  expert's intermediate (gate and up rows, down columns); the same finalize and one all-reduce.
- ``"ep-a2a"``, expert parallel, tokens sharded (attention data-parallel): each rank routes its own tokens and
  sends each (token, slot) row to the rank owning the expert (``all_to_all_single``), runs its experts on what
  it received, and sends the results back; the source's finalize weights them and adds its own shared expert.
  With ``capacity=None`` the exact row counts are exchanged first (one host sync per call: prefill). With
  ``capacity=C`` every rank sends a fixed buffer of C rows to every rank (unused rows carry expert -1): no host
  sync, so a decode step can be captured in a CUDA graph; C >= ``max tokens per rank × top_k`` can never
  overflow, a smaller C raises (checked on the device only when checks are on; see ``capacity``).

In ``"ep"`` and ``"tp"`` the shared expert is split like the routed ones by default (``shared="tp"``: rank r
holds its slice of the shared intermediate, and its partial output joins the same finalize and reduction), or
computed whole on rank 0 (``shared="rank0"``). In ``"ep-a2a"`` every rank runs the whole shared expert on its own
tokens. E must divide by W (``"ep"``, ``"ep-a2a"``) and I by W (``"tp"``; the shared intermediate too with
``shared="tp"``); anything else is a ``ValueError`` at construction, not an uneven split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

from moefuse._runtime import Backend, batch_invariant, checks_enabled, optional_bool
from moefuse.config import MoEConfig
from moefuse.finalize import DeferredFinalizeOutput, finalize_deferred_output
from moefuse.formats import ExpertWeight, QuantizedWeight, layer_format, resolve_activation_quant
from moefuse.layer import (
    ActivationQuant,
    MoELayer,
    MoERouter,
    Quant,
    SharedExpert,
    SharedQuant,
    Workspace,
    add_expert_params,
    default_shared_quant,
    expert_weights,
    init_random_,
    routed_experts,
)

Mode = Literal["ep", "tp", "ep-a2a"]
MODES: tuple[str, ...] = ("ep", "tp", "ep-a2a")


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


class ShardedMoELayer(nn.Module):
    """This rank's shard of a MoE block; ``forward`` returns the same as the full layer (see the module docstring).

    Build it with :meth:`from_layer`. Parameter names follow :class:`moefuse.MoELayer` (``gate.*``, ``experts.*``,
    ``shared_experts.*``), holding this rank's slices; ``quant``, ``shared_quant`` and ``activation_quant`` mean
    what they mean there (``from_layer`` takes the layer's).
    """

    def __init__(self, config: MoEConfig, mode: Mode, group: dist.ProcessGroup | None = None, *,
                 shared: Literal["tp", "rank0"] = "tp", capacity: int | None = None, scatter_output: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 backend: Backend = "auto", quant: Quant = None,
                 shared_quant: SharedQuant | Literal["default"] = "default",
                 activation_quant: ActivationQuant = "default", batch_invariant: bool | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if shared not in ("tp", "rank0"):
            raise ValueError(f"shared must be 'tp' or 'rank0', got {shared!r}")
        rank, world = _rank_and_size(group)
        E, I, S = config.num_experts, config.intermediate_size, config.shared_intermediate_size
        if mode in ("ep", "ep-a2a") and E % world:
            raise ValueError(f"mode={mode!r}: the {E} experts do not split evenly over {world} ranks")
        if mode == "tp" and I % world:
            raise ValueError(f"mode='tp': intermediate_size {I} does not split evenly over {world} ranks")
        split_shared = mode != "ep-a2a" and shared == "tp" and S > 0
        if split_shared and S % world:
            raise ValueError(f"shared='tp': the shared intermediate {S} does not split over {world} ranks "
                             "(use shared='rank0')")
        # A quantized weight is cut only between its scale blocks: expert TP splits I (the routed experts' and, with
        # shared="tp", the fp8 shared expert's), which must then be a multiple of the block on every rank.
        step = layer_format(quant).split_step
        if mode == "tp" and (I // world) % step:
            raise ValueError(f"mode='tp' with quant={quant!r}: each rank's {I // world} intermediate columns must be "
                             f"a multiple of {step}")
        if shared_quant == "default":
            shared_quant = default_shared_quant(quant)
        shared_step = layer_format(shared_quant, "shared_quant").split_step
        if split_shared and (S // world) % shared_step:
            raise ValueError(f"shared='tp' with shared_quant={shared_quant!r}: each rank's {S // world} shared "
                             f"intermediate columns must be a multiple of {shared_step} (its scale blocks); use "
                             f"shared='rank0'")
        if capacity is not None and (mode != "ep-a2a" or isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 1):
            raise ValueError(f"capacity must be None, or an int >= 1 with mode='ep-a2a', got {capacity!r}")
        if scatter_output and mode == "ep-a2a":
            raise ValueError("scatter_output applies to the token-replicated modes ('ep', 'tp')")
        self.config, self.mode, self.group, self.rank, self.world = config, mode, group, rank, world
        self.shared_mode, self.capacity, self.scatter_output, self.backend = shared, capacity, scatter_output, backend
        self.quant, self.shared_quant = quant, shared_quant
        self.num_local_experts = E // world if mode != "tp" else E
        width = I // world if mode == "tp" else I
        self.gate = MoERouter(config, device=device, backend=backend)
        self.experts = nn.Module()
        self.workspace = Workspace()
        local, H = self.num_local_experts, config.hidden_size
        self.format = layer_format(quant)
        add_expert_params(self.experts, self.format, local, H, width, dtype, device)  # MoELayer's names and dtypes
        # Resolved against the routed format, as MoELayer does: a combination without kernels is refused here.
        self.activation_quant = resolve_activation_quant(expert_weights(self.experts, self.format)[0], activation_quant)
        runs_shared = S > 0 and (split_shared or mode == "ep-a2a" or rank == 0)
        shared_width = S // world if split_shared else S
        self.shared_experts = (SharedExpert(config.hidden_size, shared_width, config.swiglu_limit, dtype=dtype,
                                            device=device, quant=shared_quant, backend=backend)
                               if runs_shared else None)
        self.batch_invariant = optional_bool("batch_invariant", batch_invariant)  # None: the process default
        for module in (self.gate, self.shared_experts):
            if module is not None:
                module.batch_invariant = batch_invariant

    def init_random_(self, seed: int = 0, std: float = 0.02) -> ShardedMoELayer:
        """Random weights for this shard (benchmarks; not the full layer's values: use :meth:`from_layer`)."""
        init_random_(self, seed + self.rank, std)
        return self

    @classmethod
    @torch.no_grad()
    def from_layer(cls, layer: MoELayer, mode: Mode, group: dist.ProcessGroup | None = None, *,
                   device: torch.device | str | None = None, **kwargs) -> ShardedMoELayer:
        """This rank's shard of ``layer`` (copied to ``device``, default the layer's); ``kwargs`` as ``__init__``."""
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer must be a moefuse.MoELayer, got {type(layer).__name__}")
        device = layer.experts.gate_up_proj.device if device is None else device
        kwargs.setdefault("backend", layer.backend)
        kwargs.setdefault("activation_quant", layer.activation_quant)
        kwargs.setdefault("batch_invariant", layer.batch_invariant)
        sharded = cls(layer.config, mode, group, dtype=layer.activation_dtype, device=device, quant=layer.quant,
                      shared_quant=layer.shared_quant, **kwargs)
        c, r, W = layer.config, sharded.rank, sharded.world
        sharded.gate.weight.copy_(layer.gate.weight)
        bias = sharded.gate.e_score_correction_bias
        if bias is not None and layer.gate.e_score_correction_bias is not None:  # the same config: both or neither
            bias.copy_(layer.gate.e_score_correction_bias)
        gate_up, down = layer.experts.weights()
        if mode == "tp":
            cols = _slice(c.intermediate_size, r, W)
            gate_up = _gate_up_cols(gate_up, c.intermediate_size, cols)
            down = _cut(down, 2, cols)
        else:
            experts = _slice(c.num_experts, r, W)
            gate_up, down = gate_up[experts], down[experts]
        for mine, theirs in zip(expert_weights(sharded.experts, sharded.format), (gate_up, down)):
            _copy(mine, theirs)
        if sharded.shared_experts is not None:
            src, dst = layer.shared_experts, sharded.shared_experts
            assert src is not None  # the same config
            S = c.shared_intermediate_size
            rows = _slice(S, r, W) if sharded.shared_mode == "tp" and mode != "ep-a2a" else slice(0, S)
            if layer.shared_quant is None:
                gate_up = torch.cat([src.gate_proj.weight, src.up_proj.weight])[None]
                shard_up = cast(torch.Tensor, _gate_up_cols(gate_up, S, rows))
                shard_down = cast(torch.Tensor, _cut(src.down_proj.weight[None], 2, rows))
                width = rows.stop - rows.start
                dst.gate_proj.weight.copy_(shard_up[0, :width])
                dst.up_proj.weight.copy_(shard_up[0, width:])
                dst.down_proj.weight.copy_(shard_down[0])
            else:  # one-expert fp8 stacks, [gate; up] over the shared expert's own storage
                (src_up, src_down), (dst_up, dst_down) = layer.shared_weights(), dst.stacked_weights()
                _copy(dst_up, _gate_up_cols(src_up, S, rows))
                _copy(dst_down, _cut(src_down, 2, rows))
        return sharded

    def forward(self, hidden_states: torch.Tensor, num_token_non_padded: int | torch.Tensor | None = None
                ) -> torch.Tensor:
        """[..., H] -> [..., H] (``scatter_output``: [M/W, H], this rank's rows of the flattened tokens).

        Tokens at or past ``num_token_non_padded`` (of this rank's tokens in ``"ep-a2a"``) reach no routed expert
        and get only the shared expert, as in :class:`moefuse.MoELayer`. The three phases are public so a
        benchmark can time them: :meth:`dispatch`, :meth:`compute`, :meth:`combine`.
        """
        c = self.config
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.shape[-1:] != (c.hidden_size,):
            raise ValueError(f"hidden_states must be [..., {c.hidden_size}], got {tuple(hidden_states.shape)}")
        x = hidden_states.reshape(-1, c.hidden_size)
        if self.scatter_output and x.shape[0] % self.world:
            raise ValueError(f"scatter_output: the {x.shape[0]} tokens do not split over {self.world} ranks")
        out = self.combine(self.compute(self.dispatch(x, num_token_non_padded)))
        return out if self.scatter_output else out.reshape(hidden_states.shape)

    def dispatch(self, x: torch.Tensor, num_token_non_padded: int | torch.Tensor | None = None) -> Exchange:
        """Route tokens ``x`` [M, H]; in ``"ep-a2a"`` also send each (token, slot) row to its expert's rank."""
        weights, ids = self.gate(x, num_token_non_padded)
        if self.mode == "tp":
            return Exchange(x, weights, ids)
        if self.mode == "ep":
            return Exchange(x, weights, self._local_ids(ids))
        K, W = self.config.top_k, self.world
        pairs = ids.reshape(-1).long()  # [M·K], pair t·K + k
        dest = torch.where(pairs >= 0, pairs // self.num_local_experts, W)  # rank W: no expert (-1 slot)
        # Stable order by destination: each rank's rows together, in pair order. Counts by scatter_add, not
        # bincount (which reads its input's maximum back to the host).
        order = torch.sort(dest, stable=True).indices
        counts = torch.zeros(W + 1, dtype=torch.int64, device=x.device).scatter_add_(0, dest, torch.ones_like(dest))
        pack = self._pack_exact if self.capacity is None else self._pack_capacity
        send_rows, position, send_ids, splits = pack(x, pairs, dest, order, counts[:W], K)
        recv_splits = None if splits is None else _exchange_counts(splits, self.group)
        recv_rows = _all_to_all(send_rows, splits, recv_splits, self.group)
        recv_ids = _all_to_all(send_ids, splits, recv_splits, self.group)
        return Exchange(x, weights, position, splits, recv_splits, recv_rows, recv_ids)

    def compute(self, exchange: Exchange) -> Exchange:
        """This rank's experts: on the replicated tokens, or on the rows it received."""
        if self.mode != "ep-a2a":
            exchange.routed = self._routed(exchange.x, exchange.weights, exchange.ids)
            return exchange
        # The received rows are (token, slot) pairs with top_k = 1: dispatch, experts, and back in the received
        # order (a finalize of weight 1 would round; a gather does not).
        assert exchange.recv_rows is not None and exchange.recv_ids is not None  # set by exchange() in ep-a2a
        ones = torch.ones(exchange.recv_ids.shape[0], 1, dtype=torch.float32, device=exchange.x.device)
        deferred = self._routed(exchange.recv_rows, ones, exchange.recv_ids[:, None])
        rows = deferred.expanded_idx_to_permuted_idx.long()
        exchange.results = deferred.gemm2_out[rows.clamp(min=0)]  # rows of unused slots (-1) are never read back
        return exchange

    def combine(self, exchange: Exchange) -> torch.Tensor:
        """Weighted sum with the shared expert: one finalize, then the reduction or the all-to-all back."""
        shared = self.shared_experts(exchange.x) if self.shared_experts is not None else None
        if self.mode == "ep-a2a":
            assert exchange.results is not None  # set by compute()
            back = _all_to_all(exchange.results, exchange.recv_splits, exchange.splits, self.group)
            routed = DeferredFinalizeOutput(back, exchange.weights, exchange.ids, self.config.top_k)
            return finalize_deferred_output(routed, shared, backend=self.backend)
        assert exchange.routed is not None  # set by compute()
        out = finalize_deferred_output(exchange.routed, shared, backend=self.backend)
        if batch_invariant(self.batch_invariant):
            # A collective's sum order depends on the message size (NCCL picks its algorithm by it): gather every
            # rank's partial output and add them in rank order here, the same additions at every batch size.
            parts = [torch.empty_like(out) for _ in range(self.world)]
            dist.all_gather(parts, out.contiguous(), group=self.group)
            total = parts[0].float()
            for part in parts[1:]:
                total += part.float()
            out = total.to(out.dtype)
            rows = out.shape[0] // self.world
            return out[self.rank * rows:(self.rank + 1) * rows].clone() if self.scatter_output else out
        if self.scatter_output:
            return _reduce_scatter(out, self.group)
        dist.all_reduce(out, group=self.group)
        return out

    def _local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's (0 .. E/W - 1), -1 for experts elsewhere (and for -1)."""
        local = ids - self.rank * self.num_local_experts
        return torch.where((local >= 0) & (local < self.num_local_experts), local, -1).to(torch.int32)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> DeferredFinalizeOutput:
        out = routed_experts(x, *expert_weights(self.experts, self.format), weights, ids,
                             swiglu_limit=self.config.swiglu_limit, defer=True,
                             activation_quant=self.activation_quant, backend=self.backend,
                             workspace=self.workspace.on(x.device), batch_invariant=self.batch_invariant)
        assert isinstance(out, DeferredFinalizeOutput)
        return out

    def _pack_exact(self, x, pairs, dest, order, counts, K):
        """Send buffer of exactly the valid pairs, grouped by rank; ``position`` maps pair -> its row (or -1)."""
        valid = order[: int(counts.sum())]  # the host sync of this variant: the counts decide the sizes
        position = torch.full_like(pairs, -1)
        position[valid] = torch.arange(valid.numel(), device=x.device)
        local = (pairs[valid] % self.num_local_experts).to(torch.int32)
        return x[valid // K], position.to(torch.int32), local, counts.tolist()

    def _pack_capacity(self, x, pairs, dest, order, counts, K):
        """A [W, C] send buffer: rank w's pairs in rows w·C .. w·C + count_w - 1, the rest carry expert -1."""
        C, W = self.capacity, self.world
        sorted_dest = dest[order]
        first = torch.cumsum(counts, 0) - counts  # first sorted index of each rank's pairs
        slot = torch.arange(order.numel(), device=x.device) - first.index_select(0, sorted_dest.clamp(max=W - 1))
        ok = (sorted_dest < W) & (slot < C)
        row = torch.where(ok, sorted_dest * C + slot, W * C)  # W·C: a trash row, cut off below
        _check_capacity(counts, C, self.group)
        position = torch.empty_like(pairs)
        position[order] = torch.where(ok, row, -1)
        send_ids = torch.full((W * C + 1,), -1, dtype=torch.int32, device=x.device)
        send_ids[row] = (pairs[order] % self.num_local_experts).to(torch.int32)
        send_rows = torch.zeros(W * C + 1, x.shape[1], dtype=x.dtype, device=x.device)
        send_rows[row] = x[order // K]
        return send_rows[:-1], position.to(torch.int32), send_ids[:-1], None


@dataclass
class Exchange:
    """What passes between the phases of a sharded forward.

    ``ids``: the experts of each (token, slot) for this rank's GEMMs (``"ep"``: local ids, -1 elsewhere), or in
    ``"ep-a2a"`` the row of the send buffer each pair went to (-1: none), which the combine reads results from.
    """

    x: torch.Tensor  # [M, H] this rank's tokens
    weights: torch.Tensor  # [M, K] routing weights
    ids: torch.Tensor
    splits: list[int] | None = None  # ep-a2a: rows sent to each rank (None: fixed capacity)
    recv_splits: list[int] | None = None  # ep-a2a: rows received from each rank
    recv_rows: torch.Tensor | None = None  # ep-a2a: [R, H] rows received
    recv_ids: torch.Tensor | None = None  # ep-a2a: [R] their local experts (-1: unused capacity)
    routed: DeferredFinalizeOutput | None = None  # ep, tp: this rank's expert rows
    results: torch.Tensor | None = None  # ep-a2a: [R, H] expert outputs of the received rows, in received order


def _cut(weight: ExpertWeight, dim: int, index: slice) -> ExpertWeight:
    """``weight`` narrowed to ``index`` along dim 1 (rows) or 2 (columns): a tensor's slice, a format's cut."""
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, index.start, index.stop - index.start)
    return (weight.rows if dim == 1 else weight.cols)(index.start, index.stop)


def _gate_up_cols(gate_up: ExpertWeight, width: int, cols: slice) -> ExpertWeight:
    """The gate rows ``cols`` and the up rows ``width + cols`` of a [E, 2·width, H] weight, stacked again."""
    parts = [_cut(gate_up, 1, cols), _cut(gate_up, 1, slice(width + cols.start, width + cols.stop))]
    if isinstance(gate_up, torch.Tensor):
        return torch.cat(cast(list[torch.Tensor], parts), 1)
    return type(gate_up).cat_rows(cast(Any, parts))  # parts of gate_up's own format


def _copy(dst: ExpertWeight, src: ExpertWeight) -> None:
    """Copy a weight into another of the same format and shape (a format: values and scales, in place)."""
    if isinstance(dst, QuantizedWeight):
        src_format = cast(QuantizedWeight, src)
        dst.values.copy_(src_format.values.view(dst.values.dtype))
        dst.scales.copy_(src_format.scales)
    else:
        dst.copy_(cast(torch.Tensor, src))


def _slice(n: int, rank: int, world: int) -> slice:
    return slice(rank * n // world, (rank + 1) * n // world)


def _check_capacity(counts: torch.Tensor, capacity: int, group: dist.ProcessGroup | None) -> None:
    """A row past the capacity would be dropped: an error on every rank where value checks are on (the CPU,
    ``MOEFUSE_CHECK=1``; one more small all-reduce, so that all ranks raise together instead of some waiting in
    the next collective), never during graph capture; elsewhere the caller sized C for the worst case."""
    device = counts.device
    if (torch.compiler.is_compiling() or not checks_enabled(device)
            or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        return
    busiest = counts.max().reshape(1)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=group)
    worst = int(busiest)
    if worst > capacity:
        raise ValueError(f"capacity {capacity} is too small: {worst} rows go to one rank "
                         "(use capacity >= max tokens per rank × top_k)")


def _exchange_counts(splits: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's count of rows for this rank (a tiny all-to-all, then a host sync: the exact variant's)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    send = torch.tensor(splits, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _all_to_all(tensor: torch.Tensor, send_splits: list[int] | None, recv_splits: list[int] | None,
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """``all_to_all_single`` of rows; equal splits when ``send_splits`` is None (the fixed-capacity variant)."""
    rows = tensor.shape[0] if recv_splits is None else sum(recv_splits)
    out = torch.empty(rows, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return out


def _reduce_scatter(out: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ranks and keep this rank's M/W rows (gloo has no reduce-scatter: all-reduce, then slice)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = out.shape[0] // world
    if dist.get_backend(group) == "nccl":
        mine = torch.empty(rows, *out.shape[1:], dtype=out.dtype, device=out.device)
        dist.reduce_scatter_tensor(mine, out, group=group)
        return mine
    dist.all_reduce(out, group=group)
    return out[rank * rows:(rank + 1) * rows].clone()
