"""The MoE block: router linear, route, dispatch, experts, shared expert, finalize.

Module and parameter names follow Hugging Face's DeepSeek-V3 / GLM / Qwen3-MoE blocks (``gate.weight``,
``gate.e_score_correction_bias``, ``experts.gate_up_proj``, ``experts.down_proj``, ``shared_experts.*``), so a
checkpoint's tensors load as they are and ``moefuse.from_hf`` can share a transformers block's tensors.

On CUDA the shared expert runs on a side stream while the routed experts run on the current one; with deferred
finalize (SPEC §3, on by default) the experts runner skips its own combine and one kernel does combine + shared add.
At decode sizes where the tile table says it measured faster, the shared expert runs instead as one more slot of the
grouped GEMMs (its weights are allocated as expert E of the routed tensors): see ``shared_slot_max_tokens``.
"""

from __future__ import annotations

import sys
from typing import Any, Literal, Optional, cast

import torch
from torch import nn

from moefuse import _runtime
from moefuse._checks import check_int
from moefuse._deprecation import moved_names
from moefuse._runtime import Backend
from moefuse.config import MoEConfig
from moefuse.dispatch import moe_dispatch
from moefuse.experts import configs, experts_workspace, moe_experts, plan_block_m, rows_linear
from moefuse.experts.common import rows_swiglu
from moefuse.experts.op import check_experts_shapes, cublas_mlp, mlp_on_cublas
from moefuse.experts.reference import swiglu_torch
from moefuse.finalize import (
    DeferredFinalizeOutput,
    deferred_finalize_allowed,
    deferred_finalize_context,
    deferred_finalize_enabled,
    finalize_deferred_output,
)
from moefuse.formats import (
    LAYER_FORMATS,
    ExpertWeight,
    LayerFormat,
    Quant,
    QuantizedWeight,
    SharedQuant,
    layer_format,
    resolve_activation_quant,
    tile_dtype,
)
from moefuse.graphs import DecodeGraphs, state_key
from moefuse.route import moe_fused_gate, router_logits
from moefuse.route.linear import bf16_split
from moefuse.route.reference import hash_gate_torch

GRAPH_MAX_TOKENS = 16  # default of MoELayer.graph_max_tokens: eager decode batches replay a captured graph
# A quantized layer's shared-expert slot on plans of short tiles: at most this many tiles of the shared expert's rows
# (MoELayer._short_tiles_cut_shared); plans of SLOT_TALL_ROWS rows or more (wgmma, persistent) keep it at any size.
SLOT_SHORT_TILES = 2
SLOT_SHORTEST_ROWS = 16  # the shortest plan's tile
SLOT_TALL_ROWS = 64


class MoERouter(nn.Module):
    """Router linear (fp32 logits) followed by :func:`moefuse.moe_fused_gate`; or, for a hash-routed layer
    (``hash_vocab_size``: DeepSeek-V4's first MoE layers), experts looked up in ``tid2eid[input_ids]`` and
    weighted by :func:`moefuse.route.reference.hash_gate_torch`."""

    e_score_correction_bias: torch.Tensor | None  # buffers
    tid2eid: torch.Tensor | None

    def __init__(self, config: MoEConfig, *, device: torch.device | str | None = None, backend: Backend = "auto",
                 hash_vocab_size: int | None = None):
        super().__init__()
        self.config = config
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, device=device))
        bias = torch.zeros(config.num_experts, device=device) if config.expert_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        table = None
        if hash_vocab_size is not None:
            table = torch.zeros(check_int("hash_vocab_size", hash_vocab_size, low=1), config.top_k,
                                dtype=torch.int64, device=device)
        self.register_buffer("tid2eid", table)
        self.batch_invariant: bool | None = None  # None: the process default (moefuse.set_defaults)
        self._parts: tuple[tuple[int, int, torch.device], torch.Tensor] | None = None

    def logits(self, x: torch.Tensor, unsummed: bool = False) -> torch.Tensor:
        """[M, H] -> fp32 logits [M, E] (:func:`moefuse.route.router_logits`); with ``unsummed``, a batch-invariant
        router's runs' partial sums [R, M, E] (its logits where R would be 1), for the gate to add."""
        invariant = _runtime.batch_invariant(self.batch_invariant)
        parts = self._weight_parts() if invariant and x.dtype == torch.bfloat16 and x.is_cuda else None
        return router_logits(x, self.weight, backend=self.backend, batch_invariant=invariant, weight_parts=parts,
                             unsummed=unsummed and invariant)

    def _weight_parts(self) -> torch.Tensor | None:
        """The router weight's exact bf16 split for the batch-invariant logits, made once per weight version (the
        weight is a parameter a checkpoint loads in place, which bumps its version); None while compiling."""
        if torch.compiler.is_compiling():
            return None
        key = (self.weight.data_ptr(), self.weight._version, self.weight.device)
        if self._parts is None or self._parts[0] != key:
            self._parts = (key, bf16_split(self.weight.detach().float()))
        return self._parts[1]

    def forward(self, x: torch.Tensor, num_token_non_padded: int | torch.Tensor | None = None,
                num_fused_shared_experts: int = 0, input_ids: torch.Tensor | None = None,
                unit_shared_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, H] -> (weights fp32 [M, top_k + n], ids int32 [M, top_k + n]); the scaling factor is in the weights.

        Rows at or past ``num_token_non_padded`` get ids -1 and weights 0: they reach no expert. With
        ``num_fused_shared_experts = n``, slots ``top_k..top_k+n-1`` hold ids ``E..E+n-1`` (SPEC §1), at weight 1
        with ``unit_shared_weight``. A hash-routed router needs ``input_ids`` (M token ids) and takes no fused
        shared slots.
        """
        c = self.config
        if self.tid2eid is not None:
            if input_ids is None:
                raise ValueError("a hash-routed router needs input_ids (the token ids of x)")
            return hash_gate_torch(self.logits(x), self.tid2eid[input_ids.reshape(-1)], c.scoring_func,
                                   renormalize=c.renormalize, routed_scaling_factor=c.routed_scaling_factor,
                                   num_token_non_padded=num_token_non_padded)
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()  # model.to(bf16) casts buffers too; the router takes its bias in fp32 (SPEC §1)
        return moe_fused_gate(
            self.logits(x, unsummed=True), bias, c.top_k + num_fused_shared_experts, c.scoring_func,
            num_fused_shared_experts=num_fused_shared_experts, renormalize=c.renormalize,
            routed_scaling_factor=c.routed_scaling_factor, apply_routed_scaling_factor_on_output=True,
            num_expert_group=c.num_expert_group, topk_group=c.topk_group, moe_softcapping=c.moe_softcapping,
            num_token_non_padded=num_token_non_padded, backend=self.backend,
            batch_invariant=_runtime.batch_invariant(self.batch_invariant), unit_shared_weight=unit_shared_weight,
        )


# The activations' precision in the routed experts (``moe_experts(activation_quant=...)``): "default" is the weight
# format's own (plain tensors and MXFP4: None; BlockFP8: "fp8"), None leaves them in their dtype, "fp8" quantizes
# them per token and 128 columns (SPEC §5). A str, as the op takes it (callers pass what a command line parsed);
# ``formats.resolve_activation_quant`` refuses anything else.
ActivationQuant = Optional[str]


def routed_experts(x: torch.Tensor, gate_up_proj: ExpertWeight, down_proj: ExpertWeight, weights: torch.Tensor,
                   ids: torch.Tensor, *, swiglu_limit: float | None = None, defer: bool = False,
                   activation_quant: ActivationQuant = "default", backend: Backend = "auto",
                   workspace: torch.Tensor | None = None, batch_invariant: bool | None = None,
                   persistent: str | None = None, block_m: int | None = None) -> torch.Tensor | DeferredFinalizeOutput:
    """Dispatch + grouped GEMM1/SwiGLU/GEMM2 for tokens ``x`` [M, H] routed by ``ids`` int32 [M, K] with ``weights``
    [M, K] (fp32 or bf16); then the combine into [M, H], or with ``defer`` the pieces for a fused finalize.
    ``activation_quant``, ``workspace``, ``batch_invariant`` and ``persistent`` as :func:`moefuse.moe_experts` takes
    them (the plan's tile height follows them, unless ``block_m`` gives it)."""
    num_experts = gate_up_proj.shape[0]
    top_k = ids.shape[1]
    invariant = _runtime.batch_invariant(batch_invariant)
    if block_m is None:
        block_m = plan_block_m(x.shape[0], gate_up_proj, top_k, x.dtype, activation_quant, batch_invariant=invariant,
                               persistent=persistent)
    plan = moe_dispatch(ids, num_experts, block_m, backend=backend)
    gemm2_out = moe_experts(x, gate_up_proj, down_proj, plan, swiglu_limit=swiglu_limit,
                            activation_quant=activation_quant, backend=backend, workspace=workspace,
                            batch_invariant=invariant, persistent=persistent)
    deferred = DeferredFinalizeOutput(gemm2_out, weights, plan.expanded_to_permuted, top_k)
    return deferred if defer else finalize_deferred_output(deferred, None, backend=backend)


class Workspace:
    """A module's workspace for :func:`moefuse.moe_experts` (``experts.experts_workspace``: counters the kernels
    leave zeroed, so a decode call launches no kernel to zero them), made at its first call on a device. Not a
    buffer: a module built on the meta device (as :func:`moefuse.from_hf` builds layers) and materialized with
    ``to_empty`` would hold counters that are not zero. None while ``torch.compile`` traces (the op zeroes its own)."""

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None

    def on(self, device: torch.device) -> torch.Tensor | None:
        """The workspace on ``device`` (a new one where the module has moved), or None while compiling."""
        if torch.compiler.is_compiling():
            return None
        if self._tensor is None or self._tensor.device != device:
            self._tensor = experts_workspace(device)
        return self._tensor


class MoEExperts(nn.Module):
    """The routed experts runner (:func:`routed_experts` over this module's weights).

    Inside :func:`moefuse.deferred_finalize_context` it returns a :class:`DeferredFinalizeOutput` and allocates
    no output buffer; the caller finalizes, fusing the shared expert's output into the same pass.
    """

    gate_up_proj: torch.Tensor  # parameters (the *_scale_inv ones only with quant)
    down_proj: torch.Tensor
    gate_up_proj_scale_inv: torch.Tensor
    down_proj_scale_inv: torch.Tensor

    def __init__(self, config: MoEConfig, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, backend: Backend = "auto", quant: Quant = None,
                 activation_quant: ActivationQuant = "default"):
        super().__init__()
        self.config = config
        self.backend = backend
        self.quant = quant
        self.format = layer_format(quant)
        add_expert_params(self, self.format, config.num_experts, config.hidden_size, config.intermediate_size, dtype,
                          device)
        # Resolved once, against the format (which never changes): a combination it has no kernels for (BlockFP8
        # without fp8 activations, plain tensors with them) is refused here, not at the first call.
        self.activation_quant: str | None = resolve_activation_quant(self.weights()[0], activation_quant)
        if backend != "reference":  # what the kernels take on any device; the op checks the device at the call
            check_experts_shapes(self.weights()[0], self.activation_quant)
        self.workspace = Workspace()  # the routed experts' calls run one after another on one stream
        self.batch_invariant: bool | None = None  # None: the process defaults (moefuse.set_defaults)
        self.persistent: str | None = None

    def weights(self) -> tuple[ExpertWeight, ExpertWeight]:
        """``(gate_up_proj, down_proj)`` as the experts op takes them: tensors, :class:`BlockFP8` s or
        :class:`MXFP4` s (unchecked: see :meth:`MoELayer.check_weights`)."""
        return expert_weights(self, self.format)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, defer: bool | None = None
                ) -> torch.Tensor | DeferredFinalizeOutput:
        """x [M, H], weights [M, top_k], ids int32 [M, top_k] -> out [M, H], or the deferred pieces.

        ``defer=None`` follows :func:`moefuse.deferred_finalize_context`.
        """
        if defer is None:
            defer = deferred_finalize_enabled()
        return routed_experts(x, *self.weights(), weights, ids, swiglu_limit=self.config.swiglu_limit, defer=defer,
                              activation_quant=self.activation_quant, backend=self.backend,
                              workspace=self.workspace.on(x.device), batch_invariant=self.batch_invariant,
                              persistent=self.persistent)


def expert_weights(module: Any, fmt: LayerFormat) -> tuple[ExpertWeight, ExpertWeight]:
    """A module's ``gate_up_proj`` and ``down_proj`` (and their scales, where ``fmt`` has them) as the experts op
    takes them."""
    gate_up, down = (fmt.weight(*(getattr(module, name + suffix) for suffix in fmt.suffixes))
                     for name in ("gate_up_proj", "down_proj"))
    return gate_up, down


def add_expert_params(module: nn.Module, fmt: LayerFormat, E: int, H: int, I: int, dtype: torch.dtype,
                      device: torch.device | str | None) -> None:
    """Empty ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] of ``fmt`` on ``module``, with their scales where
    it has them, named as transformers' experts name them (a checkpoint's tensors load as they are)."""
    for name, (N, K) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        for suffix, param in zip(fmt.suffixes, fmt.params(E, N, K, dtype, device)):
            setattr(module, name + suffix, param)


QUANTS: tuple[str | None, ...] = tuple(LAYER_FORMATS)
SHARED_QUANTS: tuple[str | None, ...] = tuple(name for name, f in LAYER_FORMATS.items() if f.shared_width_step)


def default_shared_quant(quant: Quant) -> SharedQuant:
    """The shared expert's format a routed format implies where none is given: fp8 block-scale beside fp8 or MXFP4
    routed experts (as DeepSeek-V3 and DeepSeek-V4 ship them), else unquantized."""
    return cast(SharedQuant, layer_format(quant).implied_shared)


class ScaledProjection(nn.Module):
    """One quantized projection's tensors, named as transformers names them: ``weight`` and one parameter per further
    suffix of its format (block-scale fp8: ``weight_scale_inv``). Not callable: :class:`MoELayer` runs it through the
    grouped GEMMs or cuBLAS (``experts.cublas_mlp``)."""

    def __init__(self, suffixes: tuple[str, ...], *tensors: torch.Tensor):
        super().__init__()
        for suffix, tensor in zip(suffixes, tensors):
            setattr(self, "weight" + suffix, nn.Parameter(tensor, requires_grad=False))


class SharedExpert(nn.Module):
    """An ordinary SwiGLU MLP (``gate_proj``, ``up_proj``, ``down_proj``), not scaled by the routing factor.

    With a quantized ``quant`` (``"fp8"``) the projections are :class:`ScaledProjection` s and the module runs as a
    one-expert grouped GEMM in that format on ``backend``, or where ``experts.mlp_on_cublas`` holds (fp8 at prefill
    on Hopper) on cuBLAS's GEMMs. Their gate and up tensors lie one after the other, so the GEMMs read them as one
    [2I, H] expert (:meth:`stacked_weights`).
    """

    gate_proj: Any  # nn.Linear, or ScaledProjection with a quantized format
    up_proj: Any
    down_proj: Any

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 quant: SharedQuant = None, backend: Backend = "auto"):
        super().__init__()
        self.limit = swiglu_limit
        self.quant = quant
        self.format = layer_format(quant, "shared_quant")
        self.backend = backend
        self.workspace = Workspace()  # its own: it runs on a side stream, beside the routed experts
        self.batch_invariant: bool | None = None  # None: the process defaults (moefuse.set_defaults)
        self.persistent: str | None = None
        if self.format.quantized:  # [gate; up] as one tensor (and scales): the grouped GEMMs read them as one expert
            gate_up = self.format.params(1, 2 * intermediate_size, hidden_size, dtype, device)
            down = self.format.params(1, hidden_size, intermediate_size, dtype, device)
            suffixes = self.format.suffixes
            self.gate_proj = ScaledProjection(suffixes, *(t[0, : t.shape[1] // 2] for t in gate_up))
            self.up_proj = ScaledProjection(suffixes, *(t[0, t.shape[1] // 2 :] for t in gate_up))
            self.down_proj = ScaledProjection(suffixes, *(t[0] for t in down))
            return
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        invariant = _runtime.batch_invariant(self.batch_invariant)
        if not self.format.quantized:
            if invariant and self.backend != "reference":  # cuBLAS picks its kernel (and sum order) by M
                project = lambda rows, proj: rows_linear(rows, proj.weight, backend=self.backend)  # noqa: E731
                return project(rows_swiglu(project(x, self.gate_proj), project(x, self.up_proj), self.limit),
                               self.down_proj)
            return self.down_proj(swiglu_torch(self.gate_proj(x), self.up_proj(x), self.limit))
        gate_up, down = self.stacked_weights()
        if self.runs_on_cublas(x.shape[0], x.dtype, x.device):
            return cublas_mlp(x, gate_up, down, self.limit)
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)
        out = routed_experts(x, gate_up, down, ones, ids, swiglu_limit=self.limit, backend=self.backend,
                             workspace=self.workspace.on(x.device), batch_invariant=invariant,
                             persistent=self.persistent)
        assert isinstance(out, torch.Tensor)
        return out

    def runs_on_cublas(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a call on ``num_tokens`` tokens of ``dtype`` on ``device`` runs a quantized MLP on cuBLAS's GEMMs
        (``experts.mlp_on_cublas``: its weights' format decides) rather than the grouped GEMMs; never batch-invariant
        (cuBLAS picks its kernel by M)."""
        hidden_size, width = self.down_proj.weight.shape
        return (self.format.quantized and self.backend != "reference"
                and not _runtime.batch_invariant(self.batch_invariant)
                and mlp_on_cublas(num_tokens, self.format.weight_type, hidden_size, width, dtype, device))

    def stacked_weights(self) -> tuple[ExpertWeight, ExpertWeight]:
        """The quantized projections as a one-expert stack (``[1, 2S, H]``, ``[1, H, S]``) in the module's format,
        over their own storage."""
        gate_up_parts, down_parts = [], []
        for suffix in self.format.suffixes:
            gate, up, down = (getattr(proj, "weight" + suffix) for proj in (self.gate_proj, self.up_proj,
                                                                            self.down_proj))
            gate_up = _stacked(gate[None], up)
            if gate_up is None:
                raise ValueError("the shared expert's gate and up tensors must lie one after the other "
                                 "(as MoELayer, from_hf and .to() put them; see moefuse.layer.stack_gate_up)")
            gate_up_parts.append(gate_up.reshape(1, -1, gate.shape[1]))
            down_parts.append(down[None])
        return self.format.weight(*gate_up_parts), self.format.weight(*down_parts)


@torch.no_grad()
def init_random_(module: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every weight of a MoE module with N(0, std²) and the expert bias with N(0, 0.01²), on the weights' device.

    Drawn one expert slice at a time, so a full-size layer needs no host-side copy of its weights.
    """
    gens: dict[torch.device, torch.Generator] = {}
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor is None or tensor.element_size() == 1:  # quantized: MoELayer quantizes drawn weights itself
            continue
        if tensor.device not in gens:
            gens[tensor.device] = torch.Generator(tensor.device).manual_seed(seed)
        scale = 0.01 if name.endswith("e_score_correction_bias") else std
        for part in tensor.view(-1, *tensor.shape[-1:]).split(4096):
            part.normal_(0.0, scale, generator=gens[tensor.device])


@torch.no_grad()
def stack_gate_up(shared: nn.Module, fmt: LayerFormat) -> None:
    """Put a quantized shared expert's gate and up tensors (values and scales, the parameters ``fmt`` names) into one
    tensor each, gate rows first, its parameters becoming views into them: the grouped GEMMs read [gate; up] as one
    expert. One copy when they do not lie so already; the values are unchanged."""
    gate, up = shared.gate_proj, shared.up_proj
    for name in ("weight" + suffix for suffix in fmt.suffixes):
        a, b = getattr(gate, name), getattr(up, name)
        if _stacked(a[None], b) is not None:
            continue
        stacked = torch.cat([a, b])
        setattr(gate, name, nn.Parameter(stacked[: a.shape[0]], requires_grad=False))
        setattr(up, name, nn.Parameter(stacked[a.shape[0]:], requires_grad=False))


def _stacked(base: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor | None:
    """``base`` [E, ...] extended by one expert over the same storage, when ``parts`` fill that expert exactly,
    one after the other (the shared expert as this layer allocates it); else None."""
    if not _fill_next_expert(base, *parts):
        return None
    return base.as_strided((base.shape[0] + 1, *base.shape[1:]), base.stride())


# Storage addresses cannot be traced: torch.compile takes this answer when it traces the forward (a weight replaced
# later by tensors that do not lie so needs stack_gate_up, as in eager mode, where the check runs every call).
@torch.compiler.assume_constant_result
def _fill_next_expert(base: torch.Tensor, *parts: torch.Tensor) -> bool:
    """Whether ``parts`` follow ``base`` [E, ...] in its storage, contiguous and of its dtype, and fill one more
    expert of its shape exactly."""
    offset = base.numel()
    if not base.is_contiguous():
        return False
    for part in parts:
        if not (part.is_contiguous() and part.dtype == base.dtype
                and part.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                and part.data_ptr() == base.data_ptr() + offset * base.element_size()):
            return False
        offset += part.numel()
    return offset == base.numel() // base.shape[0] * (base.shape[0] + 1)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the shared expert runs on, one per device for every layer (layers run one after another; and a
    module holding no stream can be deep-copied and pickled)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _check_formats(config: MoEConfig, dtype: torch.dtype, routed: LayerFormat, shared: LayerFormat) -> None:
    """Refuse (TypeError for the activations' dtype, else ValueError) what the routed and shared formats cannot run,
    naming the argument."""
    has_shared = config.num_shared_experts > 0
    for name, fmt in (("quant", routed), ("shared_quant", shared if has_shared else None)):
        if fmt is not None and fmt.activation_dtypes is not None and dtype not in fmt.activation_dtypes:
            raise TypeError(f"{name}={fmt.name!r} takes activations (dtype) in {fmt.activation_dtypes}, got {dtype}")
    step = routed.width_step
    if config.hidden_size % step or config.intermediate_size % step:
        raise ValueError(f"quant={routed.name!r} needs H and I multiples of {step} (one scale per {step}), got "
                         f"{config}")
    shared_step = shared.shared_width_step
    if shared_step is None:
        raise ValueError(f"shared_quant={shared.name!r}: no shared expert takes this format")
    if has_shared and config.shared_intermediate_size % shared_step:
        raise ValueError(f"an {shared.name} shared expert (shared_quant={shared.name!r}, the default with "
                         f"quant={routed.name!r}) needs a width (I · num_shared_experts) that is a multiple of "
                         f"{shared_step}: its gate and up blocks are separate in a checkpoint, so the one-expert GEMM "
                         f"cannot read them as one [2I, H] weight; pass shared_quant=None for a shared expert in "
                         f"{dtype}; got {config}")


class MoELayer(nn.Module):
    """A whole MoE block: ``out = Σ_k w_k · expert_{id_k}(x) + shared(x)`` for every token.

    Args:
        config: shapes and routing options (``moefuse.config.PRESETS`` has the SPEC §4 models).
        dtype: dtype of the expert and shared weights and of the activations (bf16, fp16 or fp32).
        quant: the routed experts' format. None (weights in ``dtype``), or ``"fp8"``: e4m3 with fp32 scales per
            128 x 128 block (SPEC §5; ``experts.gate_up_proj`` / ``gate_up_proj_scale_inv`` ..., as transformers
            names an FP8 checkpoint's tensors), activations in ``dtype`` (bf16 or fp16) quantized on the fly. Or
            ``"mxfp4"``, as DeepSeek-V4 ships: MXFP4 (SPEC §6; ``experts.gate_up_proj`` int8 [E, 2I, H/2],
            ``gate_up_proj_scale_inv`` ue8m0 [E, 2I, H/32] ...; H and I multiples of 32), bf16 activations.
        shared_quant: the shared expert's format: None (``shared_experts.*.weight`` in ``dtype``, run by
            ``torch.nn.Linear``), or ``"fp8"`` (block-scale as above, ``shared_experts.*.weight_scale_inv`` too;
            one shared expert whose width is a multiple of 128, as its gate and up blocks are separate in a
            checkpoint; run as a one-expert fp8 grouped GEMM, or at prefill on Hopper on cuBLAS's block-scaled
            GEMMs: ``experts.fp8_mlp.takes``). ``"default"``: what ``quant`` implies (``default_shared_quant``:
            fp8 beside fp8 or MXFP4 routed experts, as DeepSeek-V3 and V4 ship; None beside unquantized ones).
            Any routed format goes with either; only where both are the same (None and None, fp8 and fp8) can
            the shared expert run as a slot of the routed GEMMs (``shared_slot_max_tokens``; for fp8, by default
            at every batch size cuBLAS does not take, except where the plan's 16- or 32-row tiles would cut the
            shared expert's rows into more than two tiles), else it runs on the side stream.
        activation_quant: the routed experts' activations (:func:`moefuse.moe_experts`), the same at every batch
            size, so a token's output never depends on its batch: ``"default"``, the format's own (None for
            unquantized and MXFP4 experts: W4A16; ``"fp8"`` for fp8 ones: W8A8); None (unquantized; refused with
            ``quant="fp8"``); or ``"fp8"``, per token and 128 columns (refused with ``quant=None``; with
            ``quant="mxfp4"`` W4A8: its Triton kernels run on Hopper with H and I multiples of 128, the reference
            backend anywhere). Resolved and checked here (:attr:`activation_quant` holds None or ``"fp8"``). An
            fp8 shared expert is W8A8 whatever this says.
        hash_vocab_size: make this a hash-routed layer (DeepSeek-V4's first MoE layers): each token's experts are
            ``gate.tid2eid[input_ids]`` (a [vocab, top_k] table loaded from the checkpoint), weighted by the scores
            of those experts (:func:`moefuse.route.reference.hash_gate_torch`); ``forward`` then needs
            ``input_ids``. Such a layer runs its shared expert on the side stream and captures no decode graphs.
            The router weight is fp32 and its logits are computed in fp32.
        device: where to allocate the parameters (uninitialised: load a checkpoint or call ``init_random_``).
        backend: ``"auto"`` (Triton on CUDA tensors, the PyTorch reference elsewhere), ``"triton"`` or
            ``"reference"``; passed to every stage.
        shared_slot_max_tokens: batches of at most this many tokens run the shared expert as one more slot of the
            grouped GEMMs (router ``num_fused_shared_experts=1``, weight 1) instead of on the side stream. None: the
            tile table's measured value for this shape on this GPU (0, never, without one); for fp8 layers, as
            ``shared_quant`` says. It applies when the layer has one shared expert as wide as a routed one,
            ``renormalize`` is on (so the slot's weight is 1), no ``num_token_non_padded`` is given (padded tokens
            keep their shared expert), outside ``torch.compile``, and while :meth:`shared_slot_weights` finds the
            shared weights where this layer put them: right behind the routed experts' (not after ``from_hf``, or
            once ``.to()`` copied them).
        graph_max_tokens: eager calls on CUDA with at most this many tokens, outside autograd, replay a CUDA
            graph the layer captured of itself on the first call with that token count (``moefuse.graphs``: when
            it re-captures, the memory it holds). An eager decode step then costs the host a copy in, one replay
            and a copy out instead of a dozen launches. 0 turns it off; the reference backend never uses it.
        batch_invariant: None (the process default: ``moefuse.set_defaults``, ``MOEFUSE_BATCH_INVARIANT=1``) or a
            bool. True: a token's output is the same bits whatever the batch it runs in (its size, its position, the
            other tokens), on the Triton backend: every stage sums in one order at every batch size (the router
            linear on one launch, the grouped GEMMs on wgmma tiles of 64 rows or more with no split along K, the
            shared expert on the side stream through the same kernels, never a slot of the grouped GEMMs nor
            cuBLAS). What it guarantees and costs: docs/USAGE.md.
        deferred_finalize: None (the process default, on unless ``MOEFUSE_ENABLE_DEFERRED_FINALIZE=0``) or a bool:
            combine the routed rows and add the shared expert in one kernel.
        persistent: None (the process default, ``MOEFUSE_PERSISTENT``) or "auto" / "all" / "none": which persistent
            prefill GEMMs run where they apply (:func:`moefuse.moe_experts`).

    ``forward`` takes hidden states [..., H] in ``dtype`` and returns the same shape. A fixed-size decode step
    does no host synchronisation and can be captured in a CUDA graph. With one shared expert as wide as a routed
    one (every SPEC §4 model that has one) and of the routed experts' format, its weights are allocated as expert E
    of the routed tensors, and ``shared_experts.*`` and ``experts.*`` are views into them: a state dict loads into
    both as usual.
    """

    def __init__(self, config: MoEConfig, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, backend: Backend = "auto",
                 shared_slot_max_tokens: int | None = None, graph_max_tokens: int = GRAPH_MAX_TOKENS,
                 quant: Quant = None, hash_vocab_size: int | None = None,
                 shared_quant: SharedQuant | Literal["default"] = "default",
                 activation_quant: ActivationQuant = "default", batch_invariant: bool | None = None,
                 deferred_finalize: bool | None = None, persistent: str | None = None):
        super().__init__()
        routed = layer_format(quant)
        if shared_quant == "default":
            shared_quant = default_shared_quant(quant)
        elif shared_quant not in SHARED_QUANTS:
            raise ValueError(f"shared_quant must be 'default' or one of {SHARED_QUANTS}, got {shared_quant!r}")
        _check_formats(config, dtype, routed, layer_format(shared_quant, "shared_quant"))
        self.config = config
        self.backend = backend
        self.quant = quant
        self.shared_quant: SharedQuant = shared_quant if config.num_shared_experts else None
        self.shared_format = layer_format(self.shared_quant, "shared_quant")
        self._activation_dtype = dtype
        self.gate = MoERouter(config, device=device, backend=backend, hash_vocab_size=hash_vocab_size)
        # With one shared expert as wide as a routed one and of the same format, its weights are allocated right
        # behind the routed experts' (expert E of the same tensors), so the grouped GEMMs can run it as one more slot.
        stack = config.num_shared_experts == 1 and shared_quant == quant
        self.experts = MoEExperts(config, dtype=dtype, device="meta" if stack else device, backend=backend,
                                  quant=quant, activation_quant=activation_quant)
        self.shared_experts = (
            SharedExpert(config.hidden_size, config.shared_intermediate_size, config.swiglu_limit,
                         dtype=dtype, device="meta" if stack else device, quant=shared_quant, backend=backend)
            if config.num_shared_experts else None
        )
        if stack:
            self._stack_shared_behind_routed(dtype, device)
        if shared_slot_max_tokens is not None:
            check_int("shared_slot_max_tokens", shared_slot_max_tokens, low=0)
        self.shared_slot_max_tokens = shared_slot_max_tokens
        self.graphs = DecodeGraphs(check_int("graph_max_tokens", graph_max_tokens, low=0))
        self.batch_invariant = batch_invariant
        self.persistent = persistent
        self.deferred_finalize = _runtime.optional_bool("deferred_finalize", deferred_finalize)

    @property
    def batch_invariant(self) -> bool | None:
        """The layer's ``batch_invariant`` argument (None: the process default); setting it sets every stage's."""
        return self.gate.batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, value: bool | None) -> None:
        value = _runtime.optional_bool("batch_invariant", value)
        for module in (self.gate, self.experts, self.shared_experts):
            if module is not None:
                module.batch_invariant = value

    @property
    def persistent(self) -> str | None:
        """The layer's ``persistent`` argument (None: the process default); setting it sets its experts'."""
        return self.experts.persistent

    @persistent.setter
    def persistent(self, value: str | None) -> None:
        value = _runtime.persistent_arg(value)
        for module in (self.experts, self.shared_experts):
            if module is not None:
                module.persistent = value

    @classmethod
    def from_hf(cls, block: nn.Module, **kwargs: Any) -> MoELayer:
        """Deprecated since 1.0, removed in 1.1: warns, then returns :func:`moefuse.from_hf` ``(block, **kwargs)``."""
        # moefuse.hf imports this module: the new name is looked up by its dotted name at the call.
        from moefuse._deprecation import resolve, warn_deprecated

        warn_deprecated("MoELayer.from_hf", "moefuse.from_hf", removed_in="1.1")
        return cast(MoELayer, resolve("moefuse.from_hf")(block, **kwargs))

    def _stack_shared_behind_routed(self, dtype: torch.dtype, device: torch.device | str | None) -> None:
        E, I, H = self.config.num_experts, self.config.intermediate_size, self.config.hidden_size
        shared = self.shared_experts
        assert shared is not None  # stacking is for the one shared expert
        fmt = self.experts.format
        gate_up = fmt.params(E + 1, 2 * I, H, dtype, device)
        down = fmt.params(E + 1, H, I, dtype, device)
        for suffix, stacked_gate_up, stacked_down in zip(fmt.suffixes, gate_up, down):
            grad = stacked_gate_up.requires_grad  # plain weights train, quantized ones do not
            half = stacked_gate_up.shape[1] // 2  # gate rows (and their scale blocks) first
            for owner, name, tensor in ((self.experts, "gate_up_proj", stacked_gate_up[:E]),
                                        (self.experts, "down_proj", stacked_down[:E]),
                                        (shared.gate_proj, "weight", stacked_gate_up[E, :half]),
                                        (shared.up_proj, "weight", stacked_gate_up[E, half:]),
                                        (shared.down_proj, "weight", stacked_down[E])):
                setattr(owner, name + suffix, nn.Parameter(tensor, requires_grad=grad))

    def shared_slot_weights(self) -> tuple[ExpertWeight, ExpertWeight] | None:
        """``(gate_up_proj [E+1, 2I, H], down_proj [E+1, H, I])``: the routed experts with the shared expert as
        expert E, viewed over the same storage, when the shared weights still sit right behind the routed ones
        (as this layer allocates them; not after ``from_hf``, or once a parameter was replaced); else None.
        ``BlockFP8`` s (values and scales each stacked so) with ``quant="fp8"``. None where the routed and shared
        formats differ."""
        shared, experts = self.shared_experts, self.experts
        if shared is None or experts.gate_up_proj.device.type == "meta" or self.shared_quant != self.quant:
            return None  # stacked only where both are one format (never MXFP4: no shared expert is)
        gate_ups, downs = [], []
        for suffix in experts.format.suffixes:
            gate_up = _stacked(getattr(experts, "gate_up_proj" + suffix), getattr(shared.gate_proj, "weight" + suffix),
                               getattr(shared.up_proj, "weight" + suffix))
            down = _stacked(getattr(experts, "down_proj" + suffix), getattr(shared.down_proj, "weight" + suffix))
            if gate_up is None or down is None:
                return None
            gate_ups.append(gate_up)
            downs.append(down)
        return experts.format.weight(*gate_ups), experts.format.weight(*downs)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        """``.to()``, ``.cuda()`` and the like copy parameters one by one, so a quantized shared expert's gate and up
        tensors no longer lie one after the other as the grouped GEMMs read them: put them together again."""
        module = super()._apply(fn, recurse)
        shared = self.shared_experts
        if self.shared_format.quantized and shared is not None and self.shared_slot_weights() is None:
            stack_gate_up(shared, self.shared_format)
        return module

    def expert_tiles(self, num_tokens: int, device: torch.device, slot: bool) -> tuple[int, configs.TileConfig]:
        """The routed GEMMs' plan height and launch for a call on ``num_tokens`` tokens on ``device``, with the
        shared expert as one more slot or not (forward and warm-up ask this).

        The height is the routed shape's (its table's, so fp8's persistent kernels where the table runs them): the
        slot's shape has no table entry, and the heuristic's 16-row tiles there, where the table runs the persistent
        kernels, made Kimi-K2's fp8 layer 249-352 us slower than its gate and routed experts alone at 544-672 tokens
        (105-125 from 704; H100). 16-bit weights take the routed shape's whole config, the shape the table was tuned
        for (one more slot barely moves it), but for GEMM1's grid, kept to one wave (:func:`configs.slot_tiles`).
        The other formats' launches come from the heuristic at that height, which must count the slot: fp8 GEMM1's
        stages follow its waves of programs (DeepSeek-V3 at one token: 144 programs with the slot, 128 without)."""
        c = self.config
        dtype = tile_dtype(self.experts.weights()[0], self.activation_dtype)
        extra = 1 if slot and dtype not in configs.TABLE_DTYPES else 0
        block_m = self._plan_height(num_tokens, device)
        arch = configs.arch_of(device)
        tiles = configs.pick(num_tokens, c.num_experts + extra, c.hidden_size, c.intermediate_size, c.top_k + extra,
                             dtype, arch, block_m=block_m)
        if slot:
            tiles = configs.slot_tiles(tiles, num_tokens, c.num_experts, c.intermediate_size, c.top_k, dtype, arch)
        return block_m, tiles

    def _plan_height(self, num_tokens: int, device: torch.device) -> int:
        """The routed shape's plan height for a call on ``num_tokens`` tokens on ``device`` (:func:`plan_block_m`)."""
        return plan_block_m(num_tokens, self.experts.weights()[0], self.config.top_k, self.activation_dtype,
                            self.activation_quant, configs.arch_of(device),
                            batch_invariant=_runtime.batch_invariant(self.batch_invariant), persistent=self.persistent)

    def uses_shared_slot(self, num_tokens: int, device: torch.device, num_token_non_padded: object = None) -> bool:
        """Whether a call on ``num_tokens`` tokens on ``device`` runs the shared expert as a slot of the grouped
        GEMMs (see ``shared_slot_max_tokens``)."""
        return self._shared_slot(num_tokens, device, num_token_non_padded) is not None

    def _shared_slot(self, num_tokens: int, device: torch.device, num_token_non_padded: object
                     ) -> tuple[ExpertWeight, ExpertWeight] | None:
        """The stacked weights a call runs the shared expert as a slot with (:meth:`shared_slot_weights`), or None
        when it does not (see :meth:`uses_shared_slot`)."""
        c = self.config
        if (self.shared_experts is None or self.shared_quant != self.quant or not c.renormalize
                or self.gate.tid2eid is not None or torch.compiler.is_compiling()):
            return None
        limit = self.shared_slot_max_tokens
        if _runtime.batch_invariant(self.batch_invariant):
            # One way at every size, padded or not: the slot, unless turned off. On the side stream a small batch's
            # shared-expert launches trail the routed GEMMs (DeepSeek-V3 bf16, one token: 1.27x the slot's layer).
            return self.shared_slot_weights() if num_tokens > 0 and limit != 0 else None
        if num_token_non_padded is not None:
            return None  # padded tokens keep their shared expert: the side stream runs it
        if limit is None and self.experts.format.quantized:
            # The grouped GEMMs, unless cuBLAS takes it (prefill) or the plan's short tiles cut the shared expert's
            # rows into many tiles, each reading its weight again
            if (self.shared_experts.runs_on_cublas(num_tokens, self.activation_dtype, device)
                    or self._short_tiles_cut_shared(num_tokens, device)):
                limit = 0
            else:
                limit = sys.maxsize
        elif limit is None:
            limit = configs.shared_slot_max_tokens(c.num_experts, c.hidden_size, c.intermediate_size, c.top_k,
                                                   configs.arch_of(device))
        return self.shared_slot_weights() if 0 < num_tokens <= limit else None

    def _short_tiles_cut_shared(self, num_tokens: int, device: torch.device) -> bool:
        """Whether the routed shape's plan (:meth:`expert_tiles`' height) runs short tiles (16 or 32 rows) that
        would cut the shared expert's ``num_tokens`` rows into more than ``SLOT_SHORT_TILES`` of them. On the side
        stream it then runs as one expert of its own; as a slot it cost fp8 DeepSeek-V4-Flash 0.9-4% at 64-608
        tokens, DeepSeek-V3 1.1-1.3% at 128-256, GLM-4.5-Air 1.1% at 128, where at 16 tokens the slot was 3.4%
        faster, even at 24-32 and faster by 0.3-1.2% on 64- and 128-row plans (H100, layer under graph replay)."""
        if num_tokens <= SLOT_SHORT_TILES * SLOT_SHORTEST_ROWS:  # within two of any plan's tiles: no plan to ask
            return False
        block_m = self._plan_height(num_tokens, device)
        return block_m < SLOT_TALL_ROWS and num_tokens > SLOT_SHORT_TILES * block_m

    def _forward_shared_slot(self, x: torch.Tensor, gate_up_proj: ExpertWeight, down_proj: ExpertWeight,
                             num_token_non_padded: int | torch.Tensor | None = None) -> torch.Tensor:
        """The shared expert as slot ``top_k`` (id E, weight 1, also where every routed weight underflows to 0) of every
        token; padded tokens (batch-invariant layers only: others run the side stream for them) keep that slot alone,
        at weight 1."""
        c = self.config
        invariant = _runtime.batch_invariant(self.batch_invariant)
        weights, ids = self.gate(x, num_token_non_padded, num_fused_shared_experts=1, unit_shared_weight=True)
        if num_token_non_padded is not None:  # the gate gave padded rows no slot at all: restore the shared one
            padded = torch.arange(x.shape[0], device=x.device) >= num_token_non_padded
            weights[:, c.top_k] = torch.where(padded, 1.0, weights[:, c.top_k])
            ids[:, c.top_k] = c.num_experts
        block_m, tiles = self.expert_tiles(x.shape[0], x.device, slot=True)
        with configs.override(tiles):
            routed = routed_experts(x, gate_up_proj, down_proj, weights, ids, swiglu_limit=c.swiglu_limit,
                                    defer=True, activation_quant=self.activation_quant, backend=self.backend,
                                    workspace=self.experts.workspace.on(x.device), batch_invariant=invariant,
                                    persistent=self.persistent, block_m=block_m)
        return finalize_deferred_output(cast(DeferredFinalizeOutput, routed), None, backend=self.backend)

    def init_random_(self, seed: int = 0, std: float = 0.02) -> MoELayer:
        """Random weights, in place (:func:`init_random_`); returns the layer. Quantized weights (``quant``,
        ``shared_quant``): N(0, std²) drawn one expert at a time in ``dtype`` and quantized to their format
        (``BlockFP8.quantize``, ``MXFP4.quantize``)."""
        init_random_(self, seed, std)
        if self.experts.format.quantized or self.shared_format.quantized:
            self._init_quantized_(seed, std)
        return self

    @torch.no_grad()
    def _init_quantized_(self, seed: int, std: float) -> None:
        stacked = self.shared_slot_weights()  # one format: both quantized here
        weights: list[QuantizedWeight] = []
        if stacked is not None:
            weights += cast(tuple[QuantizedWeight, QuantizedWeight], stacked)
        else:  # routed first, then shared: the draws of layers built before shared_quant existed
            if self.experts.format.quantized:
                weights += cast(tuple[QuantizedWeight, QuantizedWeight], self.experts.weights())
            if self.shared_format.quantized:
                weights += cast(tuple[QuantizedWeight, QuantizedWeight], self.shared_weights())
        gen = torch.Generator(weights[0].device).manual_seed(seed + 1)
        for weight in weights:
            for expert in range(weight.shape[0]):
                drawn = torch.randn(1, *weight.shape[1:], generator=gen, device=weight.device,
                                    dtype=self.activation_dtype)
                quantized = type(weight).quantize(drawn * std)
                weight.values[expert].copy_(quantized.values[0].view(weight.values.dtype))
                weight.scales[expert].copy_(quantized.scales[0])

    def check_weights(self) -> None:
        """Check what the forward does not (it would read the device): MXFP4 scale exponents within the kernels'
        range (:data:`moefuse.formats.MXFP4_EXPONENTS`). ``from_hf``, ``patch`` and ``moefuse.warmup`` call it;
        call it after loading a state dict yourself. Raises ValueError naming the tensor."""
        fmt = self.experts.format
        for name in ("gate_up_proj", "down_proj"):
            try:
                fmt.check(*(getattr(self.experts, name + suffix) for suffix in fmt.suffixes))
            except ValueError as error:
                raise ValueError(f"experts.{name}{fmt.suffixes[-1]}: {error}") from None

    def shared_weights(self) -> tuple[ExpertWeight, ExpertWeight]:
        """A quantized shared expert as a one-expert stack in its format (``[1, 2S, H]``, ``[1, H, S]``) over its
        own storage: expert E of the stacked tensors, or its own gate and up tensors where they lie one after the
        other (as :class:`SharedExpert` and ``from_hf`` put them)."""
        if not self.shared_format.quantized:
            raise ValueError(f"the layer's shared expert is not quantized (shared_quant={self.shared_quant!r})")
        stacked = self.shared_slot_weights()
        if stacked is not None:
            E = self.config.num_experts
            return stacked[0][E:], stacked[1][E:]
        assert self.shared_experts is not None, "the layer has no shared expert"
        return self.shared_experts.stacked_weights()

    @property
    def activation_quant(self) -> str | None:
        """The routed experts' activation precision, resolved at construction: None or ``"fp8"``."""
        return self.experts.activation_quant

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype hidden states must have: the routed weights' own, or the one given at construction with
        ``quant``."""
        return self._activation_dtype if self.experts.format.quantized else self.experts.gate_up_proj.dtype

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output [M, H]: its MLP, in ``dtype`` or in fp8 (:meth:`SharedExpert.forward`)."""
        assert self.shared_experts is not None, "the layer has no shared expert"
        return self.shared_experts(x)

    @property
    def supports_deferred_finalize(self) -> bool:
        """Whether the layer defers its combine: its ``deferred_finalize`` argument, or (None) the process default
        (``MOEFUSE_ENABLE_DEFERRED_FINALIZE=0`` turns it off). Every backend can defer."""
        return deferred_finalize_allowed() if self.deferred_finalize is None else self.deferred_finalize

    def forward_deferred_finalize(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                                  ) -> DeferredFinalizeOutput:
        """Dispatch + experts with the combine left to the caller; ``x`` is [M, H]."""
        if torch.compiler.is_compiling():
            # torch.compile cannot follow a ContextVar; our runner is told directly instead.
            return self.experts(x, weights, ids, defer=True)
        with deferred_finalize_context():
            return self.experts(x, weights, ids)

    def _check_input(self, hidden_states: object) -> None:
        """The layer's own argument checks, before any stage runs (each stage checks its inputs too)."""
        dtype = self.activation_dtype
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden_states must be [..., {self.config.hidden_size}], got {tuple(hidden_states.shape)}")
        if hidden_states.dtype != dtype:
            raise TypeError(f"hidden_states must have the layer's dtype {dtype}, got {hidden_states.dtype}")
        if hidden_states.device != self.experts.gate_up_proj.device:
            raise ValueError(
                f"hidden_states is on {hidden_states.device}, the layer on {self.experts.gate_up_proj.device}")

    def forward(self, hidden_states: torch.Tensor, num_token_non_padded: int | torch.Tensor | None = None,
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] -> [..., H]. Tokens at or past ``num_token_non_padded`` (flattened order) get only the shared
        expert. ``input_ids`` (one per token, any shape) picks the experts of a hash-routed layer; other layers
        accept and ignore it, so the layer drops in where DeepSeek-V4 blocks are called."""
        self._check_input(hidden_states)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.config.hidden_size)
        if self.gate.tid2eid is not None:
            if not isinstance(input_ids, torch.Tensor) or input_ids.numel() != x.shape[0]:
                raise ValueError(f"input_ids: a hash-routed layer needs one token id per token ({x.shape[0]}), got "
                                 f"{None if input_ids is None else tuple(input_ids.shape)}")
            if input_ids.dtype not in (torch.int32, torch.int64) or input_ids.device != x.device:
                raise TypeError(f"input_ids must be int32 or int64 on {x.device}, got {input_ids.dtype} on "
                                f"{input_ids.device}")
            return self._forward_tokens(x, num_token_non_padded, input_ids).reshape(shape)
        if num_token_non_padded is None and self.backend != "reference" and self.graphs.applies(x):
            key = (state_key(self), x.device, self.backend, self.shared_slot_max_tokens, self.activation_quant,
                   self.supports_deferred_finalize, torch.is_inference_mode_enabled(),
                   _runtime.batch_invariant(self.batch_invariant), _runtime.persistent_enabled(True, self.persistent),
                   _runtime.persistent_enabled(False, self.persistent))
            return self.graphs.run(self._forward_tokens, x, key).reshape(shape)
        return self._forward_tokens(x, num_token_non_padded).reshape(shape)

    def _forward_tokens(self, x: torch.Tensor, num_token_non_padded: int | torch.Tensor | None = None,
                        input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The block on tokens ``x`` [M, H] -> [M, H]."""
        slot = self._shared_slot(x.shape[0], x.device, num_token_non_padded)
        if slot is not None:
            return self._forward_shared_slot(x, *slot, num_token_non_padded)
        weights, ids = self.gate(x, num_token_non_padded, input_ids=input_ids)
        # The shared expert forks after the router: forked first, its kernels take the SMs the router linear needs and
        # delay the routed chain (the MXFP4 layer at one token: 73.3 against 65.9 µs, H200, 2026-12-02).
        on_side_stream = x.is_cuda and self.shared_experts is not None and not torch.compiler.is_compiling()
        shared: torch.Tensor | None = None
        if on_side_stream:
            main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
            side.wait_stream(main)  # x and the router (everything before it) are ready
            with torch.cuda.stream(side):
                shared = self._shared(x)
        else:
            shared = self._shared(x) if self.shared_experts is not None else None
        if self.supports_deferred_finalize:
            routed: torch.Tensor | DeferredFinalizeOutput = self.forward_deferred_finalize(x, weights, ids)
        else:
            routed = self.experts(x, weights, ids, defer=False)
        if on_side_stream and shared is not None:
            main.wait_stream(side)
            shared.record_stream(main)  # allocated on the side stream, freed after use on this one
        if isinstance(routed, DeferredFinalizeOutput):
            return finalize_deferred_output(routed, shared, backend=self.backend)
        return routed if shared is None else routed + shared


# Deprecated since 1.0, removed in 1.1 (moefuse.reference imports this module: looked up by name at the read).
__getattr__ = moved_names(__name__, {"moe_layer_torch": "moefuse.reference.moe_layer_torch"}, removed_in="1.1")
