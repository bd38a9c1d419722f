"""Config of the `general_rl` stage: RLHF with GRPO on a weighted prompt mix.

It has the settings of every RL stage (stages.rl.settings.RLConfig: engines, loss, scheduler,
DeepSpeed and checkpoint settings: `correction` icepop/tis/none, `scheduler` c3po/sync,
`rollout`, `c3po`, ...) with the paper's general-RL numbers as defaults (arXiv 2510.18855:
GRPO, lr 3e-6, KL 0, temperature 1.0, 80 prompts x 8 outputs per step, max length 32,768;
AdamW as reasoning RL) and, unlike reasoning RL:
- `data` is a mapping source name -> {path, weight}: prompts are drawn per source by
  weight (general chat prompts, instruction-following prompts with checkable constraints,
  the prompts of human-preference pairs, ...); `domain_weights` does not apply;
- `reward` combines the reward model's score, rule rewards of the verifiers and
  format / length penalties (stages/general_rl/rewards.py);
- `reasoning_eval` scores the policy on a held-out reasoning set before and after
  training (the delta goes to MLflow and stage_summary.json). No torch import here.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from data_curation.discovery import DataInput
from stages.common.contract import Strict
from stages.common.kind_metrics import Curve
from stages.common.training_settings import with_defaults
from stages.registry import StageKind, register
from stages.rl.settings import Device, RLConfig, rl_metrics


class PromptSource(Strict):
    path: str | list[str] = Field(description="jsonl/json/parquet file(s) or dir(s): prompt rows, or "
                                              "preference pairs (their prompts are used)")
    weight: float = Field(1.0, ge=0, description="sampling weight of this source")

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


class RewardSettings(Strict):
    """reward = rm_weight * RM score (z-scored within its GRPO group when
    rm_normalization is "group"; rows a verifier scored only with rm_on_verified)
    + rule_weight * verifier score (rows with a reference)
    - format_penalty (response not `<think>...</think>answer`) - truncation_penalty (cut at
    max_len) - overlong_penalty * (share of the last `overlong_buffer` tokens used)."""

    rm_weight: float = Field(1.0, ge=0)
    rm_normalization: Literal["group", "none"] = "group"
    rm_device: Device = Field("auto", description="cpu | cuda:N | auto (rank 0's device: CPU without CUDA)")
    rm_batch_size: int = Field(16, ge=1, description="sequences per reward-model forward")
    rm_on_verified: bool = Field(False, description=(
        "also add the RM's score to rows a verifier scored (default: the verifier alone judges "
        "what it can check; stages/general_rl/rewards.py says why)"))
    rule_weight: float = Field(1.0, ge=0)
    format_penalty: float = Field(0.5, ge=0)
    require_thinking: bool = Field(True, description="the format needs a <think>...</think> section")
    truncation_penalty: float = Field(1.0, ge=0)
    overlong_buffer: int = Field(0, ge=0, description="tokens before max_len where the soft penalty ramps up")
    overlong_penalty: float = Field(0.0, ge=0)


class ReasoningEvalSettings(Strict):
    """A held-out reasoning set scored with a verifier before and after the stage, e.g. the
    first `limit` rows of gsm8k.jsonl: prompt_field "question", answer_field "answer",
    answer_regex "####\\s*(.+)$". Rows in RL format (prompt/reference) need no mapping."""

    data: str | DataInput = Field(description="rows: a path / URL, or {path, split, config} (a hub dataset such "
                                  "as {path: openai/gsm8k, config: main, split: test})")
    limit: int | None = Field(128, ge=1, description="the first N rows (null = all)")
    prompt_field: str = "prompt"
    answer_field: str = "reference"
    answer_regex: str | None = Field(None, description="the answer = group 1 of this regex over the field")
    domain: str = Field("math", description=(
        "verifier of the answers; when left unset, a row that names its own `domain` (RL-format rows, "
        "e.g. reasoning_gym ones) is scored by that domain's verifier and only rows without one by math"))
    instruction: str = Field("", description="appended to each question (e.g. the answer format)")
    max_new_tokens: int | None = Field(None, ge=1, description="default: the stage's max_len")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")

    @property
    def source(self) -> str:
        """The data as reports name it: the path, or `id[split]` of a hub dataset."""
        if isinstance(self.data, str):
            return self.data
        return self.data.path + "".join(f"[{v}]" for v in (self.data.config, self.data.split) if v)

    @field_validator("answer_regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                if re.compile(v).groups < 1:
                    raise ValueError("it needs a capturing group (the answer)")
            except re.error as e:
                raise ValueError(f"answer_regex {v!r}: {e}") from None
        return v


class GeneralRLConfig(with_defaults(RLConfig, lr=3e-6)):  # the paper's general-RL lr
    kind: Literal["general_rl"] = "general_rl"
    data: dict[str, PromptSource] = Field(min_length=1, description="source name -> {path, weight}: the prompt mix")
    reward_model: str | None = Field(None, description="a reward_model stage output (${stages.X.output})")
    reward: RewardSettings = RewardSettings()
    reasoning_eval: ReasoningEvalSettings | None = Field(
        description="held-out reasoning check before/after (required; null to skip it knowingly)")
    # the paper's general-RL numbers
    prompts_per_step: int = Field(80, ge=1, description="sync: prompts per step (C3PO++ sizes from it)")
    max_len: int = Field(32768, ge=1, description="max response tokens of a rollout")

    @model_validator(mode="before")
    @classmethod
    def _no_domain_weights(cls, values: Any) -> Any:
        if isinstance(values, dict) and "domain_weights" in values:  # reasoning_rl's key, a likely mix-up
            raise ValueError("general_rl weights prompt sources, not domains: set data.<source>.weight "
                             "instead of domain_weights")
        return values

    @model_validator(mode="after")
    def _general(self) -> "GeneralRLConfig":
        if not any(s.weight > 0 for s in self.data.values()):
            raise ValueError("data: at least one source needs a positive weight")
        r = self.reward
        if r.rm_weight > 0 and self.reward_model is None:
            raise ValueError("reward.rm_weight > 0 needs reward_model (a reward_model stage output); "
                             "set rm_weight: 0 for rule rewards only")
        if r.rm_weight == 0 and r.rule_weight == 0:
            raise ValueError("reward: rm_weight and rule_weight are both 0 (no reward signal)")
        ev = self.reasoning_eval
        if ev is not None and ev.max_new_tokens is not None and ev.max_new_tokens > self.max_len:
            raise ValueError(f"reasoning_eval.max_new_tokens ({ev.max_new_tokens}) exceeds max_len ({self.max_len}): "
                             "the rollout engine is sized for max_len")
        if r.overlong_buffer >= self.max_len:
            raise ValueError(f"reward.overlong_buffer ({r.overlong_buffer}) must be below max_len ({self.max_len})")
        return self

    @property
    def data_list(self) -> list[str]:
        return [p for s in self.data.values() for p in s.paths]


KIND = register(StageKind(
    name="general_rl", config=GeneralRLConfig, version=4,  # 2: torch engine prefills longest first (other samples per seed)
    # 3: the reasoning guard scores a row with its own `domain` unless reasoning_eval.domain is set;
    # and the bf16 torch engine keeps the rotary frequencies in fp32, as the trainer does
    # 4: verified rewards graded strictly in every domain (verifiers/grading.py): a hedged answer earns 0
    sources=("stages.general_rl", "stages.rl", "stages.reward_model", "stages.common", "verifiers"),
    distributed=True, speed="rl",
    description="RLHF: GRPO on a weighted prompt mix, reward model + rule rewards, reasoning guard",
    metrics=rl_metrics(Curve("reasoning_eval/delta"))))
