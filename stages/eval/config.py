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
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from data_curation.benchmarks import BenchmarkSource
from data_curation.discovery import DataInput
from stages.common.contract import StageConfig, Strict
from stages.registry import StageKind, register
from stages.rl.settings import GenerationSettings

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
        return [] if self.path is None else [self.path] if isinstance(self.path, str) else list(self.path)


class BenchmarkSet(EvalSet, BenchmarkSource):
    """A benchmark as it is (stages/eval/benchmarks.py), from a file or the Hugging Face Hub
    (`hub`, `config`, `split`; under RING_BENCHMARKS_DIR, `<set name>.jsonl`): which fields
    hold the question and the answer, how the gold answer is read, the verifier domain and
    the prompt."""

    path: str | list[str] | None = Field(None, description="jsonl/json/parquet file(s) or dir(s) (or `hub`)")

    question_field: str = Field(description="the field holding the question (gsm8k: question; math500: problem)")
    answer_field: str = Field(description="the field holding the answer (gsm8k: answer; minerva_math: solution)")
    answer_extractor: str = Field("field", description="how the gold answer is read from answer_field: "
                                  "field (as it is), gsm8k (the N after '#### '), boxed (the last \\boxed{})")
    id_field: str | None = Field(None, description="the field holding a row id (default: the row's file:line)")
    domain: str = Field("math", description="the verifier that scores the responses")
    prompt_template: str = Field("{question}", description="the user turn; {question} is replaced by the question")
    extraction: dict[str, Any] | None = Field(None, description="the verifier's answer extraction options per row "
                                              "(verifiers/extract.py), e.g. GSM8K: {strategies: [hashes, boxed, "
                                              "answer_is, bare, last_number]} to read its '#### N' answers")

    @model_validator(mode="after")
    def _source(self) -> "BenchmarkSet":
        self._one_source(self.path is not None)
        return self

    def inputs(self, name: str) -> "list[str | DataInput]":
        """What set `name` reads: its paths, or its hub dataset (or the local copy standing in for it)."""
        return [self.hub_input(name)] if self.hub is not None else self.paths

    @field_validator("extraction")
    @classmethod
    def _extraction(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            from verifiers.extract import ExtractionOptions  # the verifiers package: see _extractor

            ExtractionOptions.from_dict(v)  # ValueError naming the bad option
        return v

    @field_validator("answer_extractor")
    @classmethod
    def _extractor(cls, v: str) -> str:
        # every recipe validation (each CLI command) imports this config: the verifiers package that
        # benchmarks.py loads costs ~0.1 s of start-up, so only an eval stage's validation pays it
        from stages.eval.benchmarks import ANSWER_EXTRACTORS  # see the comment above

        if v not in ANSWER_EXTRACTORS:
            raise ValueError(f"answer_extractor {v!r}: known ones are {sorted(ANSWER_EXTRACTORS)}")
        return v

    @field_validator("prompt_template")
    @classmethod
    def _template(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("prompt_template must contain {question} (where the question goes)")
        return v


class LmEvalSet(Strict):
    """An lm-evaluation-harness task run on the model with lm-eval's `hf` backend (the
    `lm-eval` extra): its prompts, generation, filters and metrics are the task's own."""

    lm_eval: str | dict[str, Any] = Field(description="the task: a task YAML file, or its config inline (a dict "
                                          "in lm-eval's task YAML schema)")
    data: str | None = Field(None, description="a local jsonl/json file the task reads (sets its dataset_path to "
                             "json and its data_files); else the task's own dataset_path / dataset_kwargs")
    split: str = Field("test", description="the split name `data` is given under (the task's test_split)")
    limit: int | None = Field(None, ge=1, description="the first N documents (null = all)")
    num_fewshot: int | None = Field(None, ge=0, description="null = the task's own")
    apply_chat_template: bool = Field(False, description="render prompts with the model's chat template")
    batch_size: int = Field(8, ge=1)
    max_new_tokens: int | None = Field(None, ge=1, description="overrides the task's generation length")


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


class EvalConfig(StageConfig, GenerationSettings):
    kind: Literal["eval"] = "eval"
    models: dict[str, str] = Field(min_length=1, description="name -> HF model dir (${stages.X.output} or a URI)")
    sets: dict[str, BenchmarkSet | LmEvalSet | EvalSet | str | list[str]] = Field(
        min_length=1, description="name -> rows in the RL format (a path, a list of paths, or {path, limit}), a "
        "benchmark file with its field mapping ({path, question_field, answer_field, answer_extractor, ...}), or "
        "an lm-eval task ({lm_eval: task yaml or dict, data: local file})")
    decodings: dict[str, Decoding] = Field({"greedy": Decoding()}, min_length=1,
                                           description="name -> how responses are generated")
    # max_new_tokens, prompt_max_len, rollout, verifier_workers / _timeout_s, trust_remote_code,
    # seed: GenerationSettings

    @field_validator("models")
    @classmethod
    def _model_names(cls, v: dict[str, str]) -> dict[str, str]:
        return _names(v, "model")

    @field_validator("sets")
    @classmethod
    def _set_names(cls, v: dict) -> dict[str, EvalSet | LmEvalSet]:
        v = {k: s if isinstance(s, (EvalSet, LmEvalSet)) else EvalSet(path=s) for k, s in v.items()}
        return _names(v, "set")

    @field_validator("decodings")
    @classmethod
    def _decoding_names(cls, v: dict[str, Decoding]) -> dict[str, Decoding]:
        return _names(v, "decoding")


KIND = register(StageKind(
    name="eval", config=EvalConfig, version=4,
    # 3: the bf16 torch engine keeps the rotary frequencies in fp32, as the trainer does
    # 4: multi-line final answers, logic games' answer tags and markers are read (verifiers/extract.py)
    sources=("stages.eval", "stages.common", "stages.rl.engines", "stages.rl.decoding", "stages.rl.prompts",
             "stages.rl.verified_sampling", "stages.reasoning_rl.data", "verifiers"),
    distributed=False,
    description="accuracy (greedy, pass@k) of models on held-out verifiable sets, per set and domain"))
