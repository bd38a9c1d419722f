"""Config of the `synthetic_data` stage: locally generated data for smoke runs."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from stages.common.contract import StageConfig, Strict
from stages.registry import StageKind, register
from stages.synthetic_data.generators import get_generator


class GeneratedFile(Strict):
    generator: str = Field(description="name in stages.synthetic_data.generators.GENERATORS")
    n: int = Field(ge=1)
    seed: int = 0
    params: dict[str, Any] = {}

    @model_validator(mode="after")
    def _known_generator(self) -> "GeneratedFile":
        gen = get_generator(self.generator)  # ValueError listing the known generators
        try:
            gen.validate_params(self.params)
        except ValueError as e:
            raise ValueError(f"bad params for generator {self.generator!r}: {e}") from None
        return self


class SyntheticDataConfig(StageConfig):
    kind: Literal["synthetic_data"] = "synthetic_data"
    files: dict[str, GeneratedFile] = Field(
        min_length=1, description="output file name (e.g. sft.jsonl) -> how to generate it")

    @field_validator("files")
    @classmethod
    def _file_names(cls, files: dict[str, GeneratedFile]) -> dict[str, GeneratedFile]:
        for name in files:
            parts = name.split("/")
            if not name.endswith(".jsonl") or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"file name {name!r}: must be a relative path ending in .jsonl "
                                 "(no '..', no leading '/')")
        return files


def generator_packages(cfg: SyntheticDataConfig) -> list[str]:
    """The installed libraries the stage's generators draw with: their versions are part of
    the stage hash (pipeline/fingerprints.py)."""
    return sorted({p for f in cfg.files.values() for p in get_generator(f.generator).packages})


KIND = register(StageKind(
    name="synthetic_data", config=SyntheticDataConfig, version=1,
    sources=("stages.synthetic_data", "stages.general_rl.synthetic_prompts", "stages.common", "verifiers"),
    distributed=False, input_packages=generator_packages,
    description="synthetic Long-CoT / RL / preference data generated locally"))
