"""Config of the `curate` stage: exact/near dedup, decontamination, harmful and quality filters."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from data_curation.row_schema import FieldMap, RowPolicy
from data_curation.step_kinds import CurationStep, check_labels, default_steps, parse_steps, with_benchmarks
from stages.common.contract import StageConfig, cosmetic
from stages.common.kind_metrics import Curve, KindMetrics
from stages.registry import StageKind, register


class CurateConfig(StageConfig):
    kind: Literal["curate"] = "curate"
    data: list[str] = Field(min_length=1, description="inputs: ${stages.X.output}/file.jsonl refs, "
                            "URIs, dirs or globs (jsonl/json/parquet/arrow/dataset dirs)")
    steps: list[CurationStep] = Field(default_factory=default_steps, description="applied in order; "
                                      "each `{step: quality|exact_dedup|near_dedup|decontaminate|"
                                      "harmful|domain_tag, ...}`")
    fields: FieldMap = FieldMap()
    row_policy: RowPolicy = RowPolicy()
    output_format: Literal["jsonl", "parquet"] = "jsonl"
    min_rows: int = Field(1, ge=0, description="fail the stage when fewer rows than this are "
                          "kept (0: an empty result is accepted)")
    num_proc: int = cosmetic(2, ge=1, description="worker processes")
    batch_size: int = cosmetic(10_000, ge=1, description="rows per part (memory bound)")
    progress: bool = cosmetic(True, description="progress bars on long steps")
    only: list[str] | None = cosmetic(None, description="compute nothing before these steps: the "
                                      "earlier steps must be in the step cache (else the stage fails)")
    cache: str | None = cosmetic(None, description="step cache URL (default: "
                                 "{stage_url}/../_curate_cache/{stage})")

    @field_validator("data", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _labels(self) -> "CurateConfig":
        check_labels(list(self.steps))
        if self.only:
            labels = [s.label for s in self.steps]
            unknown = [o for o in self.only if o not in labels]
            if unknown:
                raise ValueError(f"only: no step named {unknown}; the steps are {labels}")
        return self


def rerun_config(config: dict[str, Any], only: list[str] | None = None,
                 benchmarks: str | None = None) -> dict[str, Any]:
    """A curate stage config for `ring-pipeline curate recipe.yaml --only S --benchmarks L`:
    every decontaminate step reads benchmark list L, and nothing before step S may be
    computed (the stage fails with a clear message if those steps are not cached)."""
    cfg = CurateConfig.model_validate({**config, "kind": "curate"})
    steps = list(cfg.steps)
    if benchmarks:
        steps = with_benchmarks(steps, benchmarks)
    out = cfg.model_dump(mode="json")
    out["steps"] = [s.model_dump(mode="json") for s in parse_steps(steps)]
    if only is not None:
        out["only"] = list(only)
    return CurateConfig.model_validate(out).model_dump(mode="json")


KIND = register(StageKind(
    name="curate", config=CurateConfig, version=1,
    sources=("stages.curate", "data_curation"), distributed=False,
    description="SFT data curation: quality filter, exact + near dedup, harmful filter, "
                "decontamination, domain tags, reports",
    metrics=KindMetrics(headline=(Curve("kept"), Curve("removed"), Curve("quarantined"))),
    rerun_config=rerun_config))
