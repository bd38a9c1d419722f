"""Config of the `reward_model` stage: a scalar reward model trained on preference pairs."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.common.contract import StageConfig, cosmetic
from stages.common.hf_io import trust_remote_code_field
from stages.common.kind_metrics import Curve, KindMetrics
from stages.common.precision import PRECISION_HELP
from stages.registry import StageKind, register


class RewardModelConfig(StageConfig):
    kind: Literal["reward_model"] = "reward_model"
    model: str = Field(description="HF causal-LM dir (base or SFT): ${stages.X.output} or a URI; "
                                   "a sequence-classification head (one label) is put on it")
    trust_remote_code: bool = trust_remote_code_field()
    data: str = Field(description="preference pairs (jsonl/parquet file or dir): prompt/chosen/"
                                  "rejected rows, or arena rows with a `winner` field (see data.py)")
    eval_data: str | None = Field(
        None, description="held-out pairs; without it `eval_fraction` of `data` is held out")
    eval_fraction: float = Field(0.05, ge=0, lt=1,
                                 description="share of `data` held out (by a hash of each pair)")
    ties: Literal["drop", "half"] = Field(
        "drop", description="arena ties: left out (counted), or trained with target 1/2 "
                            "(Bradley-Terry soft label, pulls the two scores together)")
    strip_thinking: bool = Field(
        True, description="score the final answer only: the <think>...</think> part of assistant "
                          "turns is removed (recorded in the output; the scorer does the same)")
    max_seq_len: int = Field(32768, ge=16, description="tokens per side of a pair (head kept)")
    max_bad_fraction: float = Field(
        0.5, ge=0, le=1, description="fail when more than this share of the rows is quarantined "
                                     "(a wrong format, not a few bad rows)")
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    micro_batch_size: int = Field(1, ge=1, description="pairs per rank per micro step")
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(9e-6, gt=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)
    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["auto", "bf16", "bf16-mixed", "fp32"] = Field("auto", description=PRECISION_HELP)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="auto = flash_attention_2 on GPU when flash-attn is installed, else sdpa")
    seed: int = 0
    eval_every: int = cosmetic(50, ge=1, description="optimizer steps between held-out evaluations")
    checkpoint_every: int = cosmetic(100, ge=1, description="optimizer steps between checkpoints")

    @model_validator(mode="after")
    def _consistent(self) -> "RewardModelConfig":
        if self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps})")
        if self.eval_data is None and self.eval_fraction == 0:
            raise ValueError("no held-out pairs: give eval_data or an eval_fraction > 0 "
                             "(held-out pairwise accuracy is the stage's measure)")
        return self


KIND = register(StageKind(
    name="reward_model", config=RewardModelConfig, version=1,
    sources=("stages.reward_model", "stages.common"), distributed=True,
    description="Bradley-Terry reward model on preference pairs (HF sequence-classification head)",
    metrics=KindMetrics(headline=(Curve("train/loss"), Curve("eval/accuracy")),
                        curves=(Curve("train/loss"), Curve("train/accuracy"), Curve("eval/accuracy"), Curve("lr")))))
