"""The step kinds, as one discriminated union over `step`, and the default order."""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from data_curation._base import CurationError
from data_curation.benchmarks import BenchmarkSpec
from data_curation.decontaminate import DecontaminateConfig
from data_curation.domains import DomainTagConfig
from data_curation.exact_dedup import ExactDedupConfig
from data_curation.harmful import HarmfulConfig
from data_curation.near_dedup import NearDedupConfig
from data_curation.quality import QualityConfig
from data_curation.step_api import StepConfig

CurationStep = Annotated[
    Union[QualityConfig, ExactDedupConfig, NearDedupConfig, DecontaminateConfig, HarmfulConfig,
          DomainTagConfig],
    Field(discriminator="step")]
STEP_KINDS: dict[str, type[StepConfig]] = {
    "quality": QualityConfig, "exact_dedup": ExactDedupConfig, "near_dedup": NearDedupConfig,
    "decontaminate": DecontaminateConfig, "harmful": HarmfulConfig, "domain_tag": DomainTagConfig}
_ADAPTER = TypeAdapter(list[CurationStep])


def check_labels(steps: list[StepConfig]) -> list[StepConfig]:
    labels = [s.label for s in steps]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise CurationError(f"step names must be unique; repeated: {dup} (give the repeated "
                            "steps a `name:`)")
    return steps


def parse_steps(raw: list[Any]) -> list[StepConfig]:
    """Step configs from dicts (or models); errors name the step and the field."""
    if not isinstance(raw, list):
        raise CurationError("steps must be a list of {step: <kind>, ...} entries")
    try:
        steps = _ADAPTER.validate_python(raw)
    except ValidationError as e:
        raise CurationError(f"invalid curation steps (known kinds: {sorted(STEP_KINDS)}):\n{e}") from e
    return check_labels(list(steps))


def default_steps(benchmarks: list[BenchmarkSpec] | str | None = None) -> list[StepConfig]:
    """The paper's SFT cleaning in a sensible order: clean first (so matching sees cleaned
    text), exact then near dedup, harmful filter, decontamination (last of the filters,
    so a new benchmark list reruns the least), then domain tagging."""
    steps: list[StepConfig] = [QualityConfig(), ExactDedupConfig(), NearDedupConfig(), HarmfulConfig()]
    if benchmarks is not None:
        steps.append(DecontaminateConfig(benchmarks=benchmarks))
    steps.append(DomainTagConfig())
    return steps


def with_benchmarks(steps: list[StepConfig], benchmarks: list[BenchmarkSpec] | str) -> list[StepConfig]:
    """The steps with every decontaminate step's benchmark list replaced."""
    if not any(isinstance(s, DecontaminateConfig) for s in steps):
        raise CurationError("--benchmarks given but the steps have no `decontaminate` step")
    if not isinstance(benchmarks, str):
        benchmarks = [b.model_dump() if isinstance(b, BenchmarkSpec) else b for b in benchmarks]
    return [DecontaminateConfig.model_validate({**s.model_dump(), "benchmarks": benchmarks})
            if isinstance(s, DecontaminateConfig) else s for s in steps]
