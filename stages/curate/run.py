"""The `curate` stage's job: fetch inputs, run data_curation, publish outputs and reports.

    python -m stages.curate.run --job job.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from data_curation import io
from data_curation._base import CurationError
from data_curation.engine import run_curation
from pipeline.stage_api import StageJob
from pipeline.tracking import StageLogger, info
from stages.curate.config import CurateConfig


def cache_url(stage_url: str, stage: str, override: str | None = None) -> str:
    """The step cache shared by every hash of this stage: a sibling of the stage dirs."""
    if override:
        return override
    return io.join(stage_url.rstrip("/").rsplit("/", 1)[0], "_curate_cache", stage)


def _in_artifact(url: str, storage_options: dict[str, Any]) -> bool:
    """Whether the URL lies in a published artifact (a parent dir with _SUCCESS)."""
    url = io.norm_url(url)
    parts = url.split("://", 1)[1].rstrip("/").split("/")
    proto = url.split("://", 1)[0]
    for up in range(0, min(4, len(parts) - 1)):
        parent = f"{proto}://" + "/".join(parts[: len(parts) - up])
        if io.exists(io.join(parent, "_SUCCESS"), storage_options):
            return True
    return False


def input_identity(data: list[str], storage_options: dict[str, Any]) -> list[Any]:
    """Content identity of the inputs: an artifact URL names its content (the producing
    stage's hash is in it); other inputs are identified by size/mtime/etag."""
    out: list[Any] = []
    for url in data:
        if _in_artifact(url, storage_options):
            out.append({"artifact": io.norm_url(url)})
        else:
            out.append({"external": [s.as_dict() for s in io.discover([url], storage_options)]})
    return out


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    c = report["counts"]
    return {"input_rows": c["input_rows"], "kept": c["kept"], "removed": c["removed"],
            "quarantined": c["quarantined"], "removed_by_step": c["removed_by_step"],
            "cache": report.get("cache_url"),
            "steps": [{"step": s["step"], "dir": s["dir"], "reused": s["reused"]}
                      for s in report["steps"]],
            **({"domain_mix_after": report["domain_mix"]["after"]} if report.get("domain_mix") else {})}


def main(job: StageJob) -> dict[str, Any]:
    cfg = CurateConfig.model_validate(job.config)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    local, names = [], {}
    for url in cfg.data:
        if any(c in url for c in "*?["):   # a glob: read in place (fetch takes files and dirs)
            local.append(url)
            continue
        path = str(job.fetch(url))
        local.append(path)
        names[path] = url
    cache = cache_url(job.stage_url, job.stage, cfg.cache)
    info(f"curate: {len(cfg.data)} input(s), {len(cfg.steps)} step(s), step cache {cache}")
    report = run_curation(
        local, list(cfg.steps), str(out), storage_options=job.storage_options,
        num_proc=cfg.num_proc, batch_size=cfg.batch_size, fields=cfg.fields, only=cfg.only,
        cache_url=cache, progress=cfg.progress, output_format=cfg.output_format,
        work_dir=Path(job.work_dir) / "curate", input_identity=input_identity(cfg.data, job.storage_options),
        input_names=names, log=info)
    summary = _summary(report)
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    log = StageLogger.for_job(job)
    c = report["counts"]
    log.metrics(0, {"input_rows": c["input_rows"], "kept": c["kept"], "removed": c["removed"],
                    "quarantined": c["quarantined"],
                    **{f"removed.{k}": v for k, v in c["removed_by_step"].items()}})
    for name in ("report.json", "report.md", "report.html"):
        log.artifact(out / name, "curation")
    return summary


def rerun_stage(config: dict[str, Any], stage_url: str, stage: str, out_url: str, *,
                only: list[str] | None = None, benchmarks_path: str | None = None,
                storage_options: dict[str, Any] | None = None, num_proc: int | None = None,
                progress: bool = True) -> dict[str, Any]:
    """Rerun steps of a curate stage outside the pipeline, against its step cache.

    `config`: the stage's resolved config (data refs already URLs); `stage_url`: the
    stage's artifact URL (any hash of it: the cache is shared); outputs go to `out_url`.
    With `only`, every step before the named ones must be cached, else CurationError."""
    from stages.curate.config import rerun_config

    so = storage_options or {}
    cfg = CurateConfig.model_validate(rerun_config(config, only, benchmarks_path))
    return run_curation(
        list(cfg.data), list(cfg.steps), out_url, storage_options=so,
        num_proc=num_proc or cfg.num_proc, batch_size=cfg.batch_size, fields=cfg.fields,
        only=cfg.only, cache_url=cache_url(stage_url, stage, cfg.cache), progress=progress,
        output_format=cfg.output_format, input_identity=input_identity(cfg.data, so))


if __name__ == "__main__":
    try:
        main(StageJob.from_argv())
    except CurationError as e:
        print(f"curate: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(0)
