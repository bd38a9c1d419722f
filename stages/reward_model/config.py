"""Config of the `reward_model` stage: a scalar reward model trained on preference pairs."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from stages.common.contract import StageConfig, cosmetic
from stages.common.hf_io import trust_remote_code_field
from stages.common.kind_metrics import Curve, KindMetrics
from stages.common.training_settings import supervised_settings
from stages.registry import StageKind, register


class RewardModelConfig(StageConfig, supervised_settings(
        lr=9e-6, adam_betas=(0.9, 0.95), weight_decay=0.0, epochs=1, warmup_steps=10, min_lr_ratio=0.1,
        checkpoint_every=100)):
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
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="auto = flash_attention_2 on GPU when flash-attn is installed, else sdpa")
    seed: int = 0
    eval_every: int = cosmetic(50, ge=1, description="optimizer steps between held-out evaluations")

    @model_validator(mode="after")
    def _consistent(self) -> "RewardModelConfig":
        if self.eval_data is None and self.eval_fraction == 0:
            raise ValueError("no held-out pairs: give eval_data or an eval_fraction > 0 "
                             "(held-out pairwise accuracy is the stage's measure)")
        return self


KIND = register(StageKind(
    name="reward_model", config=RewardModelConfig, version=1, speed="reward_model",
    sources=("stages.reward_model", "stages.common"), distributed=True,
    description="Bradley-Terry reward model on preference pairs (HF sequence-classification head)",
    metrics=KindMetrics(headline=(Curve("train/loss"), Curve("eval/accuracy")),
                        curves=(Curve("train/loss"), Curve("train/accuracy"), Curve("eval/accuracy"), Curve("lr")))))
