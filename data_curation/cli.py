"""Entry points for `ring-pipeline curate` (the CLI itself lives in pipeline/cli.py).

    curate_standalone(["data.jsonl"], "s3://bucket/clean/", "curate.yaml", ...)

A standalone config file (YAML) holds the same keys as the recipe's `curate` stage,
without `kind`/`data`:

    steps:                    # ordered; default: quality, exact_dedup, near_dedup, harmful,
      - step: quality         #   [decontaminate if --benchmarks], domain_tag
      - step: exact_dedup
      - step: near_dedup
        threshold: 0.8
      - step: decontaminate
        benchmarks: benchmarks.yaml   # or an inline list of {path, fields, name}
    fields: {messages: messages, response_roles: [assistant]}
    row_policy: {duplicate_ids: report, response_only: quarantine}
    num_proc: 2
    batch_size: 10000
    output_format: jsonl      # or parquet
    reuse_from: []            # other step caches to reuse finished steps from

Step outputs are cached under `{out}/steps/`, so `--only decontaminate` with the same
`--out` reruns decontamination (and the steps after it) against the cached earlier steps.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from data_curation import io, urls
from data_curation._base import CurationError, Strict
from data_curation.engine import run_curation
from data_curation.row_schema import FieldMap, RowPolicy
from data_curation.step_kinds import CurationStep, check_labels, default_steps, with_benchmarks


class CurateFileConfig(Strict):
    steps: list[CurationStep] | None = None
    fields: FieldMap = FieldMap()
    row_policy: RowPolicy = RowPolicy()
    num_proc: int = Field(2, ge=1)
    batch_size: int = Field(10_000, ge=1)
    output_format: Literal["jsonl", "parquet"] = "jsonl"
    reuse_from: list[str] = []


def load_config(path: str, storage_options: dict[str, Any] | None = None) -> CurateFileConfig:
    import yaml

    url = urls.normalise_url(path)
    if not io.exists(url, storage_options):
        raise CurationError(f"curation config {path} does not exist")
    fs, p = urls.filesystem(url, storage_options)
    with fs.open(p, "r", encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise CurationError(f"curation config {path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise CurationError(f"curation config {path}: expected a mapping with `steps:` etc.")
    try:
        cfg = CurateFileConfig.model_validate(data)
    except ValidationError as e:
        raise CurationError(f"curation config {path}:\n{e}") from e
    if cfg.steps:
        check_labels(list(cfg.steps))
    return cfg


def curate_standalone(data_urls: list[str], out_url: str, config_path: str | None = None,
                      only: list[str] | None = None, benchmarks_path: str | None = None,
                      storage_options: dict[str, Any] | None = None, num_proc: int | None = None,
                      progress: bool = True) -> dict[str, Any]:
    """`ring-pipeline curate data.jsonl --out URL [--config curate.yaml] [--only STEP ...]
    [--benchmarks list.yaml]`: run (or rerun parts of) the curation without a recipe.

    Returns the report (also written to `{out_url}/report.json|md|html`)."""
    cfg = load_config(config_path, storage_options) if config_path else CurateFileConfig()
    steps = list(cfg.steps) if cfg.steps else default_steps(benchmarks_path)
    if benchmarks_path and cfg.steps:
        steps = with_benchmarks(steps, benchmarks_path)
    return run_curation(data_urls, steps, out_url, storage_options=storage_options,
                        num_proc=num_proc or cfg.num_proc, batch_size=cfg.batch_size,
                        fields=cfg.fields, row_policy=cfg.row_policy, only=only,
                        reuse_from=cfg.reuse_from,
                        progress=progress, output_format=cfg.output_format)
