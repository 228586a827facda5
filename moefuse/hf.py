"""transformers integration: build a MoELayer from a sparse-MoE block, patch a model, or serve as an experts backend.

Three ways in, from lightest to fullest:

- ``register_experts_implementation()`` adds ``"moefuse"`` to transformers' experts interface, so
  ``from_pretrained(..., experts_implementation="moefuse")`` or ``model.set_experts_implementation("moefuse")``
  runs every experts module through moefuse's dispatch, grouped GEMMs and finalize (routing stays transformers').
- ``moefuse.from_hf(block)`` builds a layer that shares the block's tensors (no copy).
- ``patch(model)`` swaps every supported block for such a layer, so routing and the deferred finalize with the
  shared expert run fused too; ``unpatch(model)`` puts the original blocks back.

One registry (``SUPPORTED_BLOCKS``) maps a block's class name to how its router scores experts; everything else is
read off the block's own attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from moefuse._runtime import Backend
from moefuse.config import MoEConfig
from moefuse.formats import LayerFormat, format_of_stored, layer_format
from moefuse.hf_formats import experts_reason, shared_reason
from moefuse.layer import MoELayer, Quant, SharedQuant, Workspace, routed_experts, stack_gate_up

# Block class name -> scoring function of its router ("config" = read the router's activation).
SUPPORTED_BLOCKS: dict[str, str] = {
    "DeepseekV3MoE": "sigmoid",  # DeepSeek-V3 / R1, Kimi-K2
    "Glm4MoeMoE": "sigmoid",  # GLM-4.5 / 4.5-Air
    "DeepseekV4SparseMoeBlock": "config",  # DeepSeek-V4 (sqrt-softplus), its hash-routed layers too
    "Qwen3MoeSparseMoeBlock": "softmax",  # Qwen3-MoE
}
# A transformers module, read by attribute names (its classes vary with the model and the version): duck-typed.
HFModule = Any
_ACTIVATION_SCORING = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid", "Softmax": "softmax"}
_ORIGINAL = "_moefuse_original"  # attribute of a patched-in layer holding the block it replaced


def unsupported_reason(block: HFModule) -> str | None:
    """Why ``block`` cannot become a MoELayer, or None when it can."""
    kind = SUPPORTED_BLOCKS.get(type(block).__name__)
    if kind is None:
        return f"{type(block).__name__} is not a supported MoE block"
    if kind == "config" and type(block.gate.score_fn).__name__ not in _ACTIVATION_SCORING:
        return f"router activation {type(block.gate.score_fn).__name__}"
    reason = _experts_reason(block.experts) or _shared_reason(block)
    if reason is not None:
        return reason
    act = getattr(block.experts, "act_fn", None)
    if act is not None and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        return f"expert activation {type(act).__name__} (only SiLU)"
    return None


def quant_of(block: HFModule) -> Quant:
    """The format of a block's routed experts, read off their values' dtype (:func:`formats.format_of_stored`):
    ``"fp8"`` for transformers' FP8 experts, ``"mxfp4"`` for its FP4 ones (``expert_dtype="fp4"``), None."""
    return cast(Quant, format_of_stored(block.experts.gate_up_proj.dtype).name)


def shared_quant_of(block: HFModule) -> SharedQuant:
    """The format of a block's shared expert, read off the module itself: ``"fp8"`` for transformers' FP8Linear
    projections, None for plain ``nn.Linear`` ones (a checkpoint quantized with the shared expert in
    ``modules_to_not_convert``) and for a block without one."""
    shared = getattr(block, "shared_experts", None)
    return None if shared is None else cast(SharedQuant, format_of_stored(shared.gate_proj.weight.dtype).name)


def _experts_reason(experts: HFModule) -> str | None:
    """Why a block's routed experts cannot run here, or None: their format, read off the values' dtype, says
    (:func:`moefuse.hf_formats.experts_reason`)."""
    weight = experts.gate_up_proj
    fmt = format_of_stored(weight.dtype)
    if weight.element_size() == 1 and not fmt.quantized:
        return f"quantized experts {type(experts).__name__} in {weight.dtype}"
    return experts_reason(fmt, experts)


def _shared_reason(block: HFModule) -> str | None:
    """Why a block's shared expert cannot run here, or None: three projections of one format (plain ``nn.Linear`` s
    run as they are), which its format takes (:func:`moefuse.hf_formats.shared_reason`)."""
    shared = getattr(block, "shared_experts", None)
    if shared is None:
        return None
    projs = [getattr(shared, name) for name in ("gate_proj", "up_proj", "down_proj")]
    dtypes = {proj.weight.dtype for proj in projs}
    if len(dtypes) > 1:
        return f"shared expert projections in different formats ({sorted(map(str, dtypes))})"
    dtype = dtypes.pop()
    fmt = format_of_stored(dtype)
    if dtype.itemsize == 1 and not fmt.quantized:
        return f"quantized shared expert {type(projs[0]).__name__} in {dtype}"
    return shared_reason(fmt, projs)


def config_from_hf(block: HFModule) -> MoEConfig:
    """The MoEConfig of a supported transformers block, read off its router, experts and shared expert."""
    reason = unsupported_reason(block)
    if reason is not None:
        raise ValueError(f"block: {reason}")
    gate, experts = block.gate, block.experts
    scoring = SUPPORTED_BLOCKS[type(block).__name__]
    if scoring == "config":
        scoring = _ACTIVATION_SCORING[type(gate.score_fn).__name__]
    shared = getattr(block, "shared_experts", None)
    inter = experts.gate_up_proj.shape[1] // 2
    return MoEConfig(
        hidden_size=experts.gate_up_proj.shape[2] * layer_format(quant_of(block)).values_per_element,
        intermediate_size=inter,
        num_experts=experts.gate_up_proj.shape[0],
        top_k=gate.top_k,
        num_shared_experts=0 if shared is None else shared.gate_proj.weight.shape[0] // inter,
        num_expert_group=getattr(gate, "num_group", 1),
        topk_group=getattr(gate, "topk_group", 1),
        routed_scaling_factor=float(getattr(gate, "routed_scaling_factor", 1.0)),
        scoring_func=scoring,
        renormalize=bool(getattr(gate, "norm_topk_prob", True)),
        expert_bias=getattr(gate, "e_score_correction_bias", None) is not None,
        swiglu_limit=getattr(experts, "limit", None),
    )


def from_hf(block: HFModule, *, backend: Backend = "auto", activation_dtype: torch.dtype | None = None,
            activation_quant: str | None = "default", batch_invariant: bool | None = None,
            persistent: str | None = None, deferred_finalize: bool | None = None) -> MoELayer:
    """A MoELayer computing ``block``'s function with ``block``'s own tensors (shared, not copied).

    The routed and the shared expert's formats are read off the block's own modules (:func:`quant_of`,
    :func:`shared_quant_of`), each as it is: a checkpoint may keep the shared expert unquantized
    (``modules_to_not_convert``) beside fp8 or FP4 routed experts, or quantize the shared expert alone. A block with
    transformers' FP8 experts becomes a ``quant="fp8"`` layer: its routed expert values and fp32 scales are shared,
    ue8m0 scales converted to fp32. One with its FP4 experts becomes a ``quant="mxfp4"`` layer (bf16 activations):
    packed values and ue8m0 scales shared, fp32 power-of-two scales converted to ue8m0 once; its scale exponents
    are checked (:meth:`MoELayer.check_weights`). An fp8 shared expert's gate and up tensors are re-homed into one
    (see ``_stack_gate_up``); a plain one's ``nn.Linear`` s are taken as they are.

    ``activation_dtype``: of the hidden states, with quantized routed experts; None: the shared expert's dtype
    where it is unquantized (it must match), else bf16. With unquantized routed experts it is theirs.
    ``activation_quant``: the routed experts' activations (``MoELayer``'s argument: ``"fp8"`` runs FP4 experts
    W4A8; ``"default"`` runs each format as it defaults). ``batch_invariant``, ``persistent`` and
    ``deferred_finalize``: ``MoELayer``'s switches (None: the process defaults).
    """
    config = config_from_hf(block)
    shared = getattr(block, "shared_experts", None)
    if shared is not None and shared.gate_proj.weight.shape[0] % config.intermediate_size:
        raise ValueError("block: shared expert width is not a multiple of the routed expert width")
    quant, shared_quant = quant_of(block), shared_quant_of(block)
    table = block.gate.tid2eid if getattr(block, "is_hash", False) else None
    vocab = None if table is None else table.shape[0]
    dtype = block.experts.gate_up_proj.dtype if quant is None else _activation_dtype(shared, activation_dtype)
    layer = MoELayer(config, dtype=dtype, device="meta", backend=backend, quant=quant, shared_quant=shared_quant,
                     activation_quant=activation_quant, hash_vocab_size=vocab, batch_invariant=batch_invariant,
                     persistent=persistent, deferred_finalize=deferred_finalize)
    layer.gate.tid2eid = table
    layer.gate.weight = block.gate.weight
    layer.gate.e_score_correction_bias = getattr(block.gate, "e_score_correction_bias", None)
    layer.experts.gate_up_proj = block.experts.gate_up_proj
    layer.experts.down_proj = block.experts.down_proj
    fmt = layer.experts.format
    for name in ("gate_up_proj", "down_proj") if fmt.quantized else ():
        scales = fmt.checkpoint_scales(getattr(block.experts, name), getattr(block.experts, f"{name}_scale_inv"))
        setattr(layer.experts, f"{name}_scale_inv", nn.Parameter(scales, requires_grad=False))
    if layer.shared_format.quantized:
        _stack_gate_up(shared, layer.shared_format)
    if shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.shared_experts, name, getattr(shared, name))
    layer.check_weights()
    return layer


def _activation_dtype(shared: HFModule | None, given: torch.dtype | None) -> torch.dtype:
    """The hidden states' dtype of a layer with quantized routed experts: ``given``, or an unquantized shared
    expert's (which computes in it: a mismatch is refused here rather than by its first matmul), or bf16."""
    plain = None if shared is None or shared.gate_proj.weight.element_size() == 1 else shared.gate_proj.weight.dtype
    if given is not None and plain is not None and given != plain:
        raise ValueError(f"activation_dtype {given} differs from the unquantized shared expert's dtype {plain}: "
                         "cast the block's shared expert to it, or pass its dtype")
    return given or plain or torch.bfloat16


def _stack_gate_up(shared: HFModule, fmt: LayerFormat) -> None:
    """A quantized shared expert's gate and up as one tensor each (:func:`moefuse.layer.stack_gate_up`), its scales
    as the format keeps them first."""
    name = "weight" + fmt.suffixes[-1]
    for proj in (shared.gate_proj, shared.up_proj):
        stored = getattr(proj, name)
        scales = fmt.checkpoint_scales(proj.weight, stored)
        if scales.dtype != stored.dtype or scales.shape != stored.shape:
            setattr(proj, name, nn.Parameter(scales, requires_grad=False))
    stack_gate_up(shared, fmt)


@dataclass
class PatchReport:
    """What ``patch`` did: qualified names of the blocks replaced, and of MoE-looking blocks left alone (why)."""

    patched: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    warmup: object = None  # the WarmupReport when patch(..., warmup_tokens=N) warmed the model up


def _looks_like_moe(module: nn.Module) -> bool:
    return hasattr(module, "experts") and hasattr(module, "gate")


def patch(model: nn.Module, *, backend: Backend = "auto", warmup_tokens: int | None = None,
          activation_quant: str | None = "default", batch_invariant: bool | None = None,
          persistent: str | None = None, deferred_finalize: bool | None = None) -> PatchReport:
    """Replace every supported sparse-MoE block of ``model`` by a MoELayer sharing its tensors; returns a report.

    Unsupported blocks are left alone and listed in ``report.skipped``. Patching twice is harmless (patched
    layers are not MoE blocks any more). ``unpatch`` restores the original modules exactly. Each block's routed
    and shared expert formats are read off it (:func:`from_hf`). ``activation_quant`` goes to every layer
    (``MoELayer``'s argument, e.g. ``"fp8"`` for W4A8 FP4 experts); a block it does not apply to (``"fp8"`` on
    unquantized experts, None on fp8 ones) is a ValueError naming the block, raised before anything is replaced.
    With ``warmup_tokens``, :func:`moefuse.warmup` then compiles every kernel variant up to that many tokens (and
    captures the decode graphs), so no request waits for a compile; its report is ``report.warmup``.
    ``batch_invariant``, ``persistent`` and ``deferred_finalize`` go to every layer (``MoELayer``'s switches; None:
    the process defaults).
    """
    report = PatchReport()
    layers: dict[str, MoELayer] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, MoELayer) or not _looks_like_moe(module):
            continue
        reason = unsupported_reason(module)
        if reason is not None:
            report.skipped[name] = reason
            continue
        try:
            layers[name] = from_hf(module, backend=backend, activation_quant=activation_quant,
                                   batch_invariant=batch_invariant, persistent=persistent,
                                   deferred_finalize=deferred_finalize)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from error
    for name, layer in layers.items():  # all built: a refusal above leaves the model as it was
        object.__setattr__(layer, _ORIGINAL, model.get_submodule(name))  # not a submodule: its tensors are the layer's
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        report.patched.append(name)
    if warmup_tokens is not None:
        from moefuse.warmup import warmup

        report.warmup = warmup(model, warmup_tokens)
    return report


def unpatch(model: nn.Module) -> list[str]:
    """Put back every block that ``patch`` replaced; returns their qualified names."""
    restored = []
    for name, module in list(model.named_modules()):
        original = getattr(module, _ORIGINAL, None)
        if isinstance(module, MoELayer) and original is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, original)
            restored.append(name)
    return restored


def experts_forward(experts: HFModule, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts-interface signature, run by moefuse: dispatch, grouped GEMMs, finalize. Takes
    transformers' FP8 experts too (their ``*_scale_inv`` block scales)."""
    weights = top_k_weights if top_k_weights.dtype in (torch.float32, torch.bfloat16) else top_k_weights.float()
    gate_up, down = experts.gate_up_proj, experts.down_proj
    fmt = format_of_stored(gate_up.dtype)
    if fmt.quantized:  # the exponent range of FP4 scales is not re-checked per call (it reads the device)
        gate_up, down = (fmt.weight(getattr(experts, name), _scales(experts, fmt, f"{name}_scale_inv"))
                         for name in ("gate_up_proj", "down_proj"))
    workspace = None
    if not torch.compiler.is_compiling():  # kept on transformers' module, made at its first call
        holder = experts.__dict__.get("_moefuse_workspace")
        if holder is None:
            holder = experts.__dict__["_moefuse_workspace"] = Workspace()
        workspace = holder.on(hidden_states.device)
    out = routed_experts(hidden_states, gate_up, down, weights, top_k_index.to(torch.int32),
                         swiglu_limit=getattr(experts, "limit", None), workspace=workspace)
    return cast(torch.Tensor, out)  # not deferred


def _scales(experts: HFModule, fmt: LayerFormat, name: str) -> torch.Tensor:
    """An experts module's scales ``name`` as ``fmt`` keeps them (``checkpoint_scales``). fp32 ones are converted
    once and kept on the module until that tensor changes: FP4's conversion checks the powers of two on the host,
    which a call must not (it would stall the stream and break CUDA-graph capture)."""
    values, scales = getattr(experts, name.removesuffix("_scale_inv")), getattr(experts, name)
    if scales.dtype != torch.float32 or torch.compiler.is_compiling():
        return fmt.checkpoint_scales(values, scales)
    key = (scales.data_ptr(), scales._version, tuple(scales.shape))
    cache = experts.__dict__.setdefault("_moefuse_exponents", {})
    if name not in cache or cache[name][0] != key:
        cache[name] = (key, fmt.checkpoint_scales(values, scales))
    return cache[name][1]


def register_experts_implementation(name: str = "moefuse") -> None:
    """Add moefuse to transformers' experts interface under ``name``, for bf16 experts and (where this transformers
    has them) its FP8 experts: ``model.set_experts_implementation(name)``. Explicit: nothing is registered on
    import."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without FP8 experts
        return
    ALL_FP8_EXPERTS_FUNCTIONS.register(name, experts_forward)
