"""Run one stage: job.json -> launched processes -> published artifact.

Used by the Prefect tasks (pipeline.flow) and, without Prefect, by `run_stage` (tests,
GPU benchmarks). The stage's processes get a `StageJob`; this process never imports the
stage's code.
"""
from __future__ import annotations

import json
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.artifacts import CHECKPOINTS, ArtifactError, ArtifactStore, join, normalise_url, read_manifest
from pipeline.launch import build_command, run_job
from pipeline.plan import Plan, PlannedStage, resolve_references, stage_hash
from pipeline.stage_api import Launcher, Resources, StageJob
from pipeline.tracking import PipelineTracker
from stages.curate.gate import check_eval_suite
from stages.registry import STAGE_KINDS, StageKind

FAILED = "_FAILED"


@dataclass
class StageRun:
    """What a stage task returns: small, JSON-able, never tensors."""

    stage: str
    status: str  # "ran" | "skipped"
    url: str
    hash: str
    seconds: float = 0.0
    run_id: str | None = None
    summary: dict | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class StageTarget:
    """Everything needed to execute one stage, however it was planned."""

    recipe: str
    name: str
    kind: StageKind
    config: dict[str, Any]  # resolved: references replaced by URLs
    hash: str
    url: str
    upstream: dict[str, tuple[str, str]]  # name -> (url, hash)
    resources: Resources
    launcher: Launcher
    seed: int = 0

    @classmethod
    def from_plan(cls, plan: Plan, stage: PlannedStage) -> "StageTarget":
        return cls(plan.recipe.name, stage.name, stage.kind, stage.resolved_config(plan), stage.hash,
                   stage.url, {d: (plan[d].url, plan[d].hash) for d in stage.deps},
                   stage.resources, stage.launcher, plan.recipe.defaults.seed)


def execute(target: StageTarget, store: ArtifactStore, work_root: Path,
            tracker: PipelineTracker | None = None, force: bool = False) -> StageRun:
    if store.is_done(target.url) and not force:
        return StageRun(target.name, "skipped", target.url, target.hash)
    for dep, (url, _) in target.upstream.items():
        if not store.is_done(url):
            raise ArtifactError(f"stage {target.name!r} needs the output of {dep!r} ({url}), which is "
                                f"not published: run {dep!r} first (drop --only)")
    work = Path(work_root).resolve() / target.recipe / f"{target.name}-{target.hash[:12]}"
    output_dir, scratch = work / "output", work / "scratch"
    if output_dir.exists():
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True)
    scratch.mkdir(parents=True, exist_ok=True)
    log_path = work / "stage.log"
    log_path.unlink(missing_ok=True)
    if force:  # a forced rerun starts fresh: no published output, no checkpoints to resume
        store.unpublish(target.url)
        store.remove(target.url, CHECKPOINTS)

    run_id = tracker.start_stage(target.name, target.kind.name, target.hash, target.config) if tracker else None
    job = StageJob(recipe=target.recipe, stage=target.name, kind=target.kind.name, hash=target.hash,
                   config=target.config, stage_url=target.url, storage_options=store.storage_options,
                   upstream={d: u for d, (u, _) in target.upstream.items()},
                   output_dir=str(output_dir), work_dir=str(scratch),
                   tracking_uri=tracker.uri if tracker else None, run_id=run_id, seed=target.seed)
    job_path = work / "job.json"
    job.write(job_path)
    command = build_command(target.kind.entry, job_path, target.resources, target.launcher,
                            target.kind.distributed)
    started = time.time()
    try:
        check_eval_suite(target.name, target.config, store.storage_options)
        run_job(command, target.name, log_path, target.resources)
    except BaseException as e:
        _record_failure(store, target, e, log_path, run_id)
        if tracker and run_id:
            tracker.end_stage(run_id, "FAILED" if not isinstance(e, KeyboardInterrupt) else "KILLED",
                              [log_path])
        raise
    finished = time.time()
    (output_dir / "logs").mkdir(exist_ok=True)
    shutil.copy(log_path, output_dir / "logs" / "stage.log")
    summary_path = output_dir / "stage_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    manifest = {
        "recipe": target.recipe, "stage": target.name, "kind": target.kind.name,
        "hash": target.hash, "config": target.config,
        "upstream": {d: h for d, (_, h) in target.upstream.items()},
        "code_version": target.kind.code_version, "mlflow_run_id": run_id,
        "timings": {"started": started, "finished": finished, "seconds": finished - started},
        "command": command, "summary": summary,
    }
    store.publish(output_dir, target.url, manifest)
    store.remove(target.url, FAILED)
    if tracker and run_id:
        tracker.end_stage(run_id, "FINISHED", [log_path, *([summary_path] if summary else [])])
    return StageRun(target.name, "ran", target.url, target.hash, finished - started, run_id, summary)


def _record_failure(store: ArtifactStore, target: StageTarget, error: BaseException,
                    log_path: Path, run_id: str | None) -> None:
    """A `_FAILED` note next to the stage's outputs, for `ring-pipeline status`."""
    message = str(error) or traceback.format_exception_only(type(error), error)[-1]
    try:
        store.write_note(target.url, FAILED, {"time": time.time(), "error": message[-4000:],
                                              "run_id": run_id, "type": type(error).__name__,
                                              "log": str(log_path)})
    except Exception:  # the original error matters more than the note
        pass


def read_failure(store: ArtifactStore, url: str) -> dict | None:
    return store.read_note(url, FAILED)


def run_stage(kind: str, config: dict[str, Any], *, stage: str, storage: str,
              upstream: dict[str, str] | None = None, resources: Resources | None = None,
              launcher: Launcher = "deepspeed", recipe: str = "adhoc",
              storage_options: dict[str, Any] | None = None, tracking_uri: str | None = None,
              experiment: str = "adhoc", work_root: Path = Path(".ring/work"), seed: int = 0,
              force: bool = False) -> StageRun:
    """One stage without a recipe or Prefect (tests, benchmarks, debugging).

    `upstream` maps the stage names used in `${stages.NAME.output}` references to
    published artifact URLs; their hashes come from their manifests.
    """
    spec = STAGE_KINDS[kind]
    cfg = spec.config.model_validate({"kind": kind, **config})
    upstream = {n: normalise_url(u) for n, u in (upstream or {}).items()}
    opts = storage_options or {}
    up = {n: (u, read_manifest(u, opts)["hash"]) for n, u in upstream.items()}
    h = stage_hash(spec, cfg, {n: hh for n, (_, hh) in up.items()})
    store = ArtifactStore(join(storage, recipe), opts)
    url = store.stage_url(stage, h)
    resolved = resolve_references(cfg.model_dump(mode="json"), {n: u for n, (u, _) in up.items()})
    tracker = PipelineTracker(tracking_uri, experiment, recipe, {}) if tracking_uri else None
    target = StageTarget(recipe, stage, spec, resolved, h, url, up,
                         resources or cfg.resources or Resources(), cfg.launcher or launcher, seed)
    result = execute(target, store, work_root, tracker, force)
    if tracker:
        tracker.end("FINISHED")
    return result
