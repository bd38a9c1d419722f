"""Config of the `distill` stage: Long-CoT SFT chats sampled from a teacher model and kept
only where the verifiers accept them (rejection sampling, the way cold-start data is built).

    cold_start:
      kind: distill
      teacher: "${stages.base.output}"               # any HF model dir / URI the pipeline loads
      data: "${stages.data.output}/rl.jsonl"         # RL rows: domain, prompt, reference
      samples_per_prompt: 8
      temperature: 0.8
      max_new_tokens: 1024
      min_tokens: 8
      max_tokens: 1024
      max_per_prompt: 2

The rows are the RL format (stages/reasoning_rl/data.py) of any verifier domain; the output
`sft.jsonl` holds `messages` chats the `curate` and `sft` stages read. No torch import here:
validating a recipe stays fast.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from stages.common.contract import StageConfig, cosmetic
from stages.common.kind_metrics import Curve, KindMetrics
from stages.common.training_settings import with_defaults
from stages.reasoning_rl.config import VerifiableData
from stages.registry import StageKind, register
from stages.rl.settings import GenerationSettings, RolloutSettings

# the shared settings, in the words of this kind
_DISTILL_DATA = with_defaults(VerifiableData, "DistillData", descriptions={"data": (
    "prompt rows with verifiable answers: data inputs (files, dirs, saved or hub datasets; see "
    "RLData for `split`, field names and a default domain) with a domain, a prompt and a reference")})
_DISTILL_GENERATION = with_defaults(GenerationSettings, "DistillGeneration", rollout=RolloutSettings(sleep="none"),
                                    descriptions={
    "max_new_tokens": "response tokens per sample (longer ones are cut)",
    "prompt_max_len": "longer prompts are skipped (counted per family)",
    "rollout": ("the rollout engine that samples (engine, device, dtype, max_batch, options; "
                "device auto = cuda when there is one, else cpu); it never sleeps (no trainer beside it)")})


class DistillConfig(StageConfig, _DISTILL_DATA, _DISTILL_GENERATION):
    kind: Literal["distill"] = "distill"
    teacher: str = Field(description="the teacher: HF model dir (${stages.X.output} or a URI)")
    limit: int | None = Field(None, ge=1, description="the first N rows (null = all)")
    family_field: str = Field("task", min_length=1, description=(
        "the row field that names a row's task family in the report (reasoning_gym rows name their "
        "family in `task`); rows without it report under their domain"))
    system_prompt: str | None = Field(None, min_length=1, description=(
        "a system message the teacher is prompted with (null = the user turn alone)"))
    keep_system_prompt: bool = Field(True, description="the system message stays in the written chats")
    samples_per_prompt: int = Field(4, ge=1, description="k: responses sampled per prompt")
    temperature: float = Field(1.0, ge=0, description="0 = greedy (then samples_per_prompt must be 1)")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    min_score: float = Field(1.0, gt=0, le=1, description="a response is accepted when its verifier score is >= this")
    require_eos: bool = Field(True, description="drop responses cut at max_new_tokens (no EOS): an "
                                                "unfinished answer teaches the student not to stop")
    min_tokens: int = Field(1, ge=1, description="kept responses have at least this many tokens")
    max_tokens: int | None = Field(None, ge=1, description="kept responses have at most this many tokens "
                                                           "(null = max_new_tokens)")
    max_per_prompt: int = Field(1, ge=1, description="kept responses per prompt (distinct ones, in sample order)")
    min_rows: int = Field(1, ge=0, description="fail the stage when fewer chats than this are kept")
    batch_prompts: int = Field(64, ge=1, description="prompts sampled per engine call; the unit of resume")
    checkpoint_every: int = cosmetic(1, ge=1, description="checkpoint after every N prompt batches")

    @field_validator("rollout", mode="before")
    @classmethod
    def _never_sleeps(cls, v: object) -> object:
        # nothing trains beside the engine: a vLLM engine needs no sleep mode here
        return {"sleep": "none", **v} if isinstance(v, dict) else v

    @model_validator(mode="after")
    def _consistent(self) -> DistillConfig:
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError(f"samples_per_prompt={self.samples_per_prompt} with temperature 0: greedy "
                             "responses are all the same; set a temperature > 0 or samples_per_prompt: 1")
        if self.max_tokens is not None and self.max_tokens > self.max_new_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) > max_new_tokens ({self.max_new_tokens}): "
                             "no response is longer than max_new_tokens")
        if self.min_tokens > self.longest:
            raise ValueError(f"min_tokens ({self.min_tokens}) > max_tokens ({self.longest}): no response "
                             "can be kept")
        if self.rollout.gpus is not None:
            raise ValueError("rollout.gpus: distill runs one engine in one process (no split placement)")
        return self

    @property
    def longest(self) -> int:
        """The longest response kept, in tokens."""
        return self.max_new_tokens if self.max_tokens is None else self.max_tokens


KIND = register(StageKind(
    name="distill", config=DistillConfig, version=3,
    # 2: the bf16 torch engine keeps the rotary frequencies in fp32, as the trainer does
    # 3: multi-line final answers, logic games' answer tags and markers are read (verifiers/extract.py)
    sources=("stages.distill", "stages.common", "stages.rl.engines", "stages.rl.decoding", "stages.rl.prompts",
             "stages.rl.verified_sampling", "stages.reasoning_rl.data", "verifiers"),
    distributed=False,
    description="Long-CoT SFT chats sampled from a teacher, kept where the verifiers accept them",
    # per batch: the running acceptance rate and kept chats (the finish line's are the run's)
    metrics=KindMetrics(headline=(Curve("acceptance_rate"), Curve("kept")),
                        curves=(Curve("acceptance_rate"), Curve("kept"), Curve("response_len_mean")))))
