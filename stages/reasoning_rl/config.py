"""Config of the `reasoning_rl` stage: RLVR with GRPO + IcePop, rollouts scheduled by C3PO++.

The shared RL settings and the paper's reasoning-RL defaults are `stages.rl.settings.RLConfig`;
this kind adds its data (verifiable RL rows) and how prompts are drawn across domains.
No torch import here: validating a recipe stays fast.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from stages.registry import StageKind, register
from stages.rl.settings import RLConfig


class ReasoningRLConfig(RLConfig):
    kind: Literal["reasoning_rl"] = "reasoning_rl"
    data: str | list[str] = Field(description="RL rows (jsonl/json/parquet files or dirs) with "
                                              "domain, prompt, reference (id optional)")
    domain_weights: dict[str, float] | None = Field(
        None, description="sampling weight per domain; default: proportional to row counts")

    @field_validator("data")
    @classmethod
    def _data(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("data: give at least one file or directory")
        return v

    @field_validator("domain_weights")
    @classmethod
    def _weights(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None:
            bad = {d: w for d, w in v.items() if w < 0}
            if bad:
                raise ValueError(f"domain_weights must be >= 0: {bad}")
            if not any(w > 0 for w in v.values()):
                raise ValueError("domain_weights: at least one domain needs a positive weight")
        return v

    @property
    def data_list(self) -> list[str]:
        return [self.data] if isinstance(self.data, str) else list(self.data)


KIND = register(StageKind(
    name="reasoning_rl", config=ReasoningRLConfig, version=1,
    sources=("stages.reasoning_rl", "stages.rl", "stages.common", "verifiers"), distributed=True,
    description="RLVR: GRPO with IcePop, C3PO++ rollout scheduling, verifiable rewards"))
