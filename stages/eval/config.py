"""Config of the `eval` stage: accuracy of one or more models on held-out verifiable sets.

    eval_sft:
      kind: eval
      models: {sft: "${stages.sft.output}"}          # or any HF model dir / URI
      sets: {heldout: "${stages.data.output}/heldout.jsonl"}
      decodings:
        greedy: {}                                     # temperature 0, one response per row
        sampled: {temperature: 1.0, samples: 8, pass_at: [1, 8]}

Rows are the RL format (domain, prompt, reference; stages/reasoning_rl/data.py), scored by
the verifier of their domain. No torch import here: validating a recipe stays fast.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from stages.common.contract import StageConfig, Strict
from stages.common.hf_io import trust_remote_code_field
from stages.registry import StageKind, register
from stages.rl.settings import RolloutSettings

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # names become MLflow metric path segments


def _names(v: dict, what: str) -> dict:
    bad = [k for k in v if not _NAME.match(k)]
    if bad:
        raise ValueError(f"{what} names {bad}: use letters, digits, '_', '-' and '.' (they name metrics)")
    return v


class EvalSet(Strict):
    path: str | list[str] = Field(description="jsonl/json/parquet file(s) or dir(s) of rows with "
                                              "domain, prompt, reference")
    limit: int | None = Field(None, ge=1, description="the first N rows (null = all)")

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


class Decoding(Strict):
    """How responses are generated: greedy (temperature 0, one sample) or sampled (`samples`
    responses per row; accuracy = mean over samples, and the unbiased pass@k for each k)."""

    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    samples: int = Field(1, ge=1, description="responses per row")
    pass_at: list[int] = Field([], description="k of pass@k, each <= samples")

    @model_validator(mode="after")
    def _consistent(self) -> "Decoding":
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(f"samples={self.samples} with temperature 0: greedy responses are all the "
                             "same; set a temperature > 0 or samples: 1")
        bad = [k for k in self.pass_at if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"pass_at {bad}: each k must be between 1 and samples ({self.samples})")
        return self


class EvalConfig(StageConfig):
    kind: Literal["eval"] = "eval"
    models: dict[str, str] = Field(min_length=1, description="name -> HF model dir (${stages.X.output} or a URI)")
    sets: dict[str, EvalSet | str | list[str]] = Field(
        min_length=1, description="name -> rows (a path, a list of paths, or {path, limit})")
    decodings: dict[str, Decoding] = Field({"greedy": Decoding()}, min_length=1,
                                           description="name -> how responses are generated")
    max_new_tokens: int = Field(1024, ge=1, description="response tokens per row (longer ones are cut)")
    prompt_max_len: int = Field(1024, ge=1, description="longer prompts are skipped (counted)")
    rollout: RolloutSettings = Field(RolloutSettings(), description="the rollout engine that generates "
                                     "(device auto = cuda when there is one, else cpu)")
    verifier_workers: int = Field(2, ge=0, description="verifier processes (0 = in the stage)")
    verifier_timeout_s: float = Field(10.0, gt=0)
    trust_remote_code: bool = trust_remote_code_field()
    seed: int = 0

    @field_validator("models")
    @classmethod
    def _model_names(cls, v: dict[str, str]) -> dict[str, str]:
        return _names(v, "model")

    @field_validator("sets")
    @classmethod
    def _set_names(cls, v: dict) -> dict[str, EvalSet]:
        v = {k: s if isinstance(s, EvalSet) else EvalSet(path=s) for k, s in v.items()}
        return _names(v, "set")

    @field_validator("decodings")
    @classmethod
    def _decoding_names(cls, v: dict[str, Decoding]) -> dict[str, Decoding]:
        return _names(v, "decoding")


KIND = register(StageKind(
    name="eval", config=EvalConfig, version=1,
    sources=("stages.eval", "stages.common", "stages.rl.engines", "stages.reasoning_rl.data", "verifiers"),
    distributed=False,
    description="accuracy (greedy, pass@k) of models on held-out verifiable sets, per set and domain"))
