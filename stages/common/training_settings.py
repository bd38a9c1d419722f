"""The settings every training kind shares, declared once: the optimizer, ZeRO and what it
trains (`OptimizerSettings`, with its `lora:` block `LoraSettings`: sft, reward_model and the
RL kinds) and the supervised schedule
(`SupervisedSettings`: sft and reward_model). A kind's config inherits the class
`optimizer_settings(...)` / `supervised_settings(...)` returns, which holds the same fields
with the kind's defaults: the YAML keys stay flat (`lr:`, `zero_stage:` ...), and so does the
stage hash. Pydantic only, no torch: every recipe validation imports these.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from stages.common.contract import Strict, added_later, auto_setting, cosmetic
from stages.common.precision import PRECISION_HELP

# MoE routers' expert bias that only selects experts (aux-loss-free balancing: Ling 2.0's
# `expert_bias`, DeepSeek-V3's `e_score_correction_bias`): no loss gives it a gradient
MOE_ROUTER_BIAS = ("*.gate.e_score_correction_bias", "*expert_bias*")
FROZEN_PARAMS_HELP = ("fnmatch patterns of parameter names kept fixed: no gradient, no optimizer state, no weight "
                      "decay (default: MoE routers' selection-only expert bias, which no loss trains; compiled "
                      "layers would hand DeepSpeed a missing gradient for it)")

# the projections of the decoder layers of llama / qwen / mistral-style models
DEFAULT_LORA_TARGETS = ("*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj")


class LoraSettings(Strict):
    """Low-rank adapters (LoRA, through peft) instead of training every weight: the base's
    weights stay frozen, each target linear layer W learns W + (alpha / rank) * B @ A
    (stages/common/lora.py)."""

    rank: int = Field(16, ge=1, description="the adapters' rank r (A: r x in, B: out x r)")
    alpha: float = Field(32.0, gt=0, description="the scale's numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "dropout on the adapters' input (sft, reward_model; the RL kinds train with every dropout off "
        "and refuse one above 0)"))
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1,
                                      description=(
        "fnmatch patterns on module names (e.g. `*.q_proj`, `model.layers.1*.mlp.*_proj`): the linear "
        "layers that get adapters; a pattern that matches no linear layer is an error"))
    train_fully: list[str] = Field(default_factory=list, description=(
        "fnmatch patterns on module names trained in full beside the adapters (e.g. `lm_head`); "
        "reward_model always trains its new score head `score` fully"))
    publish: Literal["merged", "adapter"] = Field("merged", description=(
        "what the stage's artifact holds: the model with the adapters merged into its weights (what "
        "the next stage and any HF tool load), or the adapter alone (peft's adapter_config.json + "
        "adapter_model.safetensors) with the base model's artifact reference and hash"))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class OptimizerSettings(Strict):
    """The torch AdamW under DeepSpeed (stages/common/deepspeed_setup.py), its ZeRO stage, and
    whether it trains every weight or low-rank adapters (`lora`)."""

    lr: float = Field(gt=0, description="the AdamW learning rate (the schedule's peak)")
    adam_betas: tuple[float, float] = Field(description="AdamW (beta1, beta2)")
    weight_decay: float = Field(ge=0, description="AdamW weight decay of matrices (none on norms and biases)")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clipping")
    zero_stage: Literal["auto", 0, 1, 2, 3] = auto_setting(2, description=(
        "DeepSpeed ZeRO stage; auto = the fastest measured that fits the GPU's memory (stages/common/"
        "speed_defaults.py: ZeRO-0 with bf16-mixed where it fits; 2 on CPU ranks)"))
    lora: LoraSettings | None = added_later(None, description=(
        "train low-rank adapters instead of every weight (LoraSettings); unset: every weight trains"))
    frozen_param_patterns: list[str] = added_later(list(MOE_ROUTER_BIAS), description=FROZEN_PARAMS_HELP)

    @field_validator("frozen_param_patterns")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        if any(not p.strip() for p in v):
            raise ValueError("frozen_param_patterns: empty pattern")
        return v


class SupervisedSettings(OptimizerSettings):
    """How long and in what batches a supervised kind trains, and its learning-rate schedule."""

    epochs: int = Field(ge=1)
    max_steps: int | None = Field(None, ge=1, description=(
        "stop after this many optimizer steps; overrides `epochs` (the data repeats as needed)"))
    micro_batch_size: Literal["auto"] | Annotated[int, Field(ge=1)] = auto_setting(1, description=(
        "items per rank per micro step (sft: packed sequences; reward_model: pairs); auto = what was measured "
        "fastest (sft on a GPU: 4 packs of up to 4,096 tokens where the memory estimate fits them, "
        "else 2 when they fit, grad_accum divided so the packs per optimizer step stay grad_accum; else 1)"))
    grad_accum: int = Field(1, ge=1, description="micro steps per optimizer step (with micro_batch_size auto: "
                                                 "items per rank per optimizer step, re-split when auto picks more "
                                                 "than one item per micro step)")
    lr_schedule: Literal["cosine", "constant"] = Field("cosine", description="after the warmup: cosine "
                                                       "down to min_lr_ratio * lr at the last step, or constant")
    warmup_steps: int = Field(ge=0, description="optimizer steps of linear warmup")
    min_lr_ratio: float = Field(ge=0, le=1, description="the cosine schedule's floor, a share of lr")
    precision: Literal["auto", "bf16", "bf16-mixed", "fp32"] = Field("auto", description=PRECISION_HELP)
    # `auto` speed settings (zero_stage, micro_batch_size, precision, ...): stages/common/speed_defaults.py
    checkpoint_every: int = cosmetic(ge=1, description="optimizer steps between checkpoints")

    @model_validator(mode="after")
    def _warmup_fits(self) -> "SupervisedSettings":
        if self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps})")
        return self


def with_defaults(base: type[Strict], name: str | None = None, *,
                  descriptions: dict[str, str | None] | None = None, hashed_at_default: tuple[str, ...] = (),
                  **defaults: Any) -> type:
    """`base` with new defaults (and descriptions) for some of its fields (each field keeps its
    type, constraints and the rest): how a kind gives a setting declared elsewhere its own
    default, or says what the setting means in that kind. `hashed_at_default`: `added_later`
    settings this kind had before they were shared, so its stage hashes have always held them."""
    name = name or base.__name__
    descriptions = descriptions or {}
    unknown = (set(defaults) | set(descriptions) | set(hashed_at_default)) - set(base.model_fields)
    if unknown:
        raise TypeError(f"{name}: no such settings {sorted(unknown)}")
    changes: dict[str, dict[str, Any]] = {}
    for field, value in defaults.items():
        changes.setdefault(field, {})["default"] = value
    for field, text in descriptions.items():
        changes.setdefault(field, {})["description"] = text
    for field in hashed_at_default:
        extra = dict(base.model_fields[field].json_schema_extra or {})
        extra.pop("hash_unless_default", None)
        changes.setdefault(field, {})["json_schema_extra"] = extra
    fields: dict[str, Any] = {
        field: (base.model_fields[field].annotation, FieldInfo.merge_field_infos(base.model_fields[field], **change))
        for field, change in changes.items()}
    return create_model(name, __base__=base, **fields)


def optimizer_settings(*, lr: float, adam_betas: tuple[float, float], weight_decay: float,
                       **more: Any) -> type[OptimizerSettings]:
    """OptimizerSettings with a kind's defaults."""
    return with_defaults(OptimizerSettings, lr=lr, adam_betas=adam_betas, weight_decay=weight_decay, **more)


def supervised_settings(*, lr: float, adam_betas: tuple[float, float], weight_decay: float, epochs: int,
                        warmup_steps: int, min_lr_ratio: float, checkpoint_every: int,
                        **more: Any) -> type[SupervisedSettings]:
    """SupervisedSettings with a kind's defaults."""
    return with_defaults(SupervisedSettings, lr=lr, adam_betas=adam_betas, weight_decay=weight_decay, epochs=epochs,
                         warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, checkpoint_every=checkpoint_every,
                         **more)
