"""Configuration of a MoE block, and presets for the models of SPEC §4."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")


@dataclass(frozen=True)
class MoEConfig:
    """Everything that fixes what a MoE block computes (weights aside).

    The routed scaling factor is always folded into the routing weights, as the models' own code does; the
    shared expert (an MLP of width ``shared_intermediate_size``) is not scaled.
    """

    hidden_size: int  # H: model width
    intermediate_size: int  # I: width of one routed expert
    num_experts: int  # E: routed experts
    top_k: int  # routed experts per token
    num_shared_experts: int = 0  # 0 = no shared expert; else its width is I * num_shared_experts
    num_expert_group: int = 1  # G: DeepSeek-V3 grouped selection (1 = off)
    topk_group: int = 1  # groups kept per token
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"  # one of SCORING_FUNCS
    renormalize: bool = True  # divide the top-k weights by their sum
    expert_bias: bool = True  # the router has an e_score_correction_bias (selection only)
    swiglu_limit: float | None = None  # DeepSeek-V4 clamp: gate <= limit, up in [-limit, limit]
    moe_softcapping: float = 0.0  # softmax scoring only: logits -> c * tanh(logits / c)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "num_expert_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.num_experts % self.num_expert_group:
            raise ValueError(f"num_expert_group ({self.num_expert_group}) must divide num_experts ({self.num_experts})")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0 or None, got {self.swiglu_limit}")

    @property
    def shared_intermediate_size(self) -> int:
        return self.intermediate_size * self.num_shared_experts

    def scaled(self, *, hidden_size: int = 256, intermediate_size: int = 128,
               num_experts: int | None = None) -> MoEConfig:
        """The same routing with small widths (and, if asked, fewer experts): for CPU runs and tests."""
        experts = self.num_experts if num_experts is None else num_experts
        return dataclasses.replace(
            self, hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=experts
        )


PRESETS: dict[str, MoEConfig] = {
    "deepseek-v3": MoEConfig(7168, 2048, 256, 8, num_shared_experts=1, num_expert_group=8, topk_group=4,
                             routed_scaling_factor=2.5),
    "kimi-k2": MoEConfig(7168, 2048, 384, 8, num_shared_experts=1, routed_scaling_factor=2.827),
    "deepseek-v4-flash": MoEConfig(4096, 2048, 256, 6, num_shared_experts=1, routed_scaling_factor=1.5,
                                   scoring_func="sqrtsoftplus", swiglu_limit=10.0),
    "qwen3-30b-a3b": MoEConfig(2048, 768, 128, 8, scoring_func="softmax", expert_bias=False),
    "glm-4.5-air": MoEConfig(4096, 1408, 128, 8, num_shared_experts=1, routed_scaling_factor=1.0),
}


def preset(name: str) -> MoEConfig:
    """The config of a SPEC §4 model by name (``moefuse.config.PRESETS`` lists them)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
