"""Config of the `reasoning_rl` stage: RLVR with GRPO + IcePop, rollouts scheduled by C3PO++.

The shared RL settings and the paper's reasoning-RL defaults are `stages.rl.settings.RLConfig`;
this kind adds its data (verifiable RL rows) and how prompts are drawn across domains.
No torch import here: validating a recipe stays fast.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from data_curation.discovery import DataInput
from stages.common.contract import Strict
from stages.common.kind_metrics import Curve
from stages.registry import StageKind, register
from stages.rl.settings import RLConfig, rl_metrics


class RLFields(Strict):
    """Which field of a row holds each part of an RL task."""

    prompt: str = Field("prompt", description="the question (a string)")
    reference: str = Field("reference", description="what the verifier checks against (any JSON)")
    domain: str = Field("domain", description="the verifier's domain (math, code, logic, ifeval, ...)")
    id: str = Field("id", description="optional row id (default: the row's file:line)")


class RLData(DataInput):
    """RL rows and where their parts are (stages/reasoning_rl/data.py)."""

    fields: RLFields = RLFields()
    default_domain: str | None = Field(None, min_length=1, description="the domain of rows without one "
                                       "(a dataset of one domain rarely has the field)")


class VerifiableData(Strict):
    """The `data` of a kind that reads RL rows (reasoning_rl, distill): one input or several,
    at least one."""

    data: str | RLData | list[str | RLData] = Field(description=(
        "RL rows: data inputs (files, dirs, saved or hub datasets; see RLData for `split`, field "
        "names and a default domain) with a domain, a prompt and a reference (id optional)"))

    @field_validator("data")
    @classmethod
    def _data(cls, v: str | RLData | list[str | RLData]) -> str | RLData | list[str | RLData]:
        if isinstance(v, list) and not v:
            raise ValueError("data: give at least one file or directory")
        return v

    @property
    def data_list(self) -> list[RLData]:
        return [d if isinstance(d, RLData) else RLData(path=d)
                for d in (self.data if isinstance(self.data, list) else [self.data])]


class ReasoningRLConfig(RLConfig, VerifiableData):
    kind: Literal["reasoning_rl"] = "reasoning_rl"
    domain_weights: dict[str, float] | None = Field(
        None, description="sampling weight per domain; default: proportional to row counts")

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


KIND = register(StageKind(
    name="reasoning_rl", config=ReasoningRLConfig, version=4,  # 2: torch engine prefills longest first (other samples per seed)
    # 3: the bf16 torch engine keeps the rotary frequencies in fp32, as the trainer does
    # 4: rewards graded strictly in every domain (verifiers/grading.py): a hedged answer earns 0;
    #    multi-line final answers are read whole
    sources=("stages.reasoning_rl", "stages.rl", "stages.common", "verifiers"), distributed=True, speed="rl",
    description="RLVR: GRPO with IcePop, C3PO++ rollout scheduling, verifiable rewards",
    metrics=rl_metrics(Curve("icepop/masked_fraction", ("masked_fraction",)))))
