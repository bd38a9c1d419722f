"""The `curate` stage's job: fetch inputs, run data_curation, publish outputs and reports.

    python -m stages.curate.job --job job.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from data_curation import discovery, io, urls
from data_curation._base import CurationError
from data_curation.engine import run_curation
from stages.common import secrets
from stages.common.contract import StageError, StageJob
from stages.common.entry import run_job
from stages.common.stage_log import StageLogger, info
from stages.curate.config import CurateConfig


class CurateError(StageError):
    """A curation problem the user can fix (data, config, benchmark list, missing step cache)."""


def cache_url(stage_url: str, stage: str, override: str | None = None) -> str:
    """The step cache shared by every hash of this stage: a sibling of the stage dirs."""
    if override:
        return override
    return urls.join(stage_url.rstrip("/").rsplit("/", 1)[0], "_curate_cache", stage)


def _in_artifact(url: str, storage_options: dict[str, Any]) -> bool:
    """Whether the URL lies in a published artifact (a parent dir with _SUCCESS)."""
    url = urls.normalise_url(url)
    parts = url.split("://", 1)[1].rstrip("/").split("/")
    proto = url.split("://", 1)[0]
    for up in range(0, min(4, len(parts) - 1)):
        parent = f"{proto}://" + "/".join(parts[: len(parts) - up])
        if io.exists(urls.join(parent, "_SUCCESS"), storage_options):
            return True
    return False


def input_identity(data: list[str], storage_options: dict[str, Any]) -> list[Any]:
    """Content identity of the inputs: an artifact URL names its content (the producing
    stage's hash is in it); other inputs are identified by size/mtime/etag."""
    out: list[Any] = []
    for url in data:
        if _in_artifact(url, storage_options):
            out.append({"artifact": urls.normalise_url(url)})
        else:
            # written into the step cache: an input's user info as its reference (stages.common.secrets)
            out.append({"external": secrets.public([s.as_dict() for s in discovery.discover([url], storage_options)])})
    return out


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    c = report["counts"]
    return {"input_rows": c["input_rows"], "kept": c["kept"], "removed": c["removed"],
            "quarantined": c["quarantined"], "removed_by_step": c["removed_by_step"],
            "cache": report.get("cache_url"),
            "steps": [{"step": s["step"], "dir": s["dir"], "reused": s["reused"]}
                      for s in report["steps"]],
            "contamination_items_found": {f"{s['step']}.{name}": b["items_found"]
                                          for s in report["steps"] if s.get("kind") == "decontaminate"
                                          for name, b in s["details"]["benchmarks"].items()},
            **({"domain_mix_after": report["domain_mix"]["after"]} if report.get("domain_mix") else {})}


def main(job: StageJob, cfg: CurateConfig) -> dict[str, Any]:
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    local, names = [], {}
    for url in cfg.data:
        if any(c in url for c in "*?["):   # a glob: read in place (fetch takes files and dirs)
            local.append(url)
            continue
        path = str(job.fetch(url))
        local.append(path)
        names[path] = secrets.public(url)  # reports name their inputs
    cache = cache_url(job.stage_url, job.stage, cfg.cache)
    info(f"curate: {len(cfg.data)} input(s), {len(cfg.steps)} step(s), step cache {cache}")
    try:
        report = run_curation(
            local, list(cfg.steps), str(out), storage_options=job.storage_options,
            num_proc=cfg.num_proc, batch_size=cfg.batch_size, fields=cfg.fields,
            row_policy=cfg.row_policy, only=cfg.only, cache_url=cache, progress=cfg.progress,
            output_format=cfg.output_format, work_dir=Path(job.work_dir) / "curate",
            input_identity=input_identity(cfg.data, job.storage_options), input_names=names, log=info)
    except CurationError as e:
        raise CurateError(str(e)) from e
    summary = _summary(report)
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    log = StageLogger.for_job(job)
    c = report["counts"]
    log.metrics(0, {"input_rows": c["input_rows"], "kept": c["kept"], "removed": c["removed"],
                    "quarantined": c["quarantined"],
                    **{f"removed.{k}": v for k, v in c["removed_by_step"].items()},
                    **contamination_metrics(out / "contamination.json")})
    for name in ("report.json", "report.md", "report.html", "contamination.json"):
        if (out / name).exists():
            log.artifact(out / name, "curation")
    check_kept(report, cfg.min_rows)
    return summary


def contamination_metrics(manifest_path: Path) -> dict[str, float]:
    """Per benchmark: benchmark items found in the input, training rows flagged, rows that
    are the same template with new numbers (MLflow metrics; the manifest is an artifact)."""
    if not manifest_path.exists():
        return {}
    out: dict[str, float] = {}
    for step in json.loads(manifest_path.read_text())["steps"]:
        for name, b in step["benchmarks"].items():
            for key in ("items_found", "rows_flagged", "rows_new_numbers"):
                out[f"contamination.{step['step']}.{name}.{key}"] = b[key]
    return out


def check_kept(report: dict[str, Any], min_rows: int) -> None:
    """A curation that keeps fewer than `min_rows` rows fails the stage (its reports are
    already in MLflow), naming where the rows went."""
    c = report["counts"]
    if c["kept"] >= min_rows:
        return
    removed = ", ".join(f"{k} {v}" for k, v in c["removed_by_step"].items() if v) or "none"
    reasons = ", ".join(f"{k!r} {v}" for k, v in report["quarantine"]["reasons"].items()) or "none"
    raise CurateError(
        f"kept {c['kept']} of {c['input_rows']} input rows, fewer than min_rows = {min_rows}: "
        f"removed by step: {removed}; quarantined {c['quarantined']} (reasons: {reasons}); "
        "see report.md in the stage's MLflow run (artifacts/curation)")


if __name__ == "__main__":
    sys.exit(run_job(main, CurateConfig))
