"""Run one stage: lease -> job.json -> launched processes -> published artifact.

Used by the Prefect tasks (pipeline.flow) and, without Prefect, by `run_stage` (tests,
GPU benchmarks). The stage's processes get a `StageJob`; this process never imports the
stage's code.

One executor per stage at a time: the stage's `_RUNNING` lease (pipeline.lease) is held
from before the job starts until after it is published; a second executor waits for it
(and then skips the published stage) or fails naming the holder. Each attempt has its own
work directory (`{work}/{recipe}/{stage}-{hash12}/{attempt}/`), so concurrent or successive
attempts never delete each other's outputs or logs.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from data_curation.urls import join, normalise_url
from pipeline import console, interrupt
from pipeline.artifacts import ArtifactStore
from pipeline.changes import code_record
from pipeline.failures import StageFailure
from pipeline.fingerprints import PACKAGE_INPUT, Fingerprint
from pipeline.interrupt import StageInterrupted
from pipeline.launch import LaunchResult, launch_command, launch_job
from pipeline.lease import Lease, LeaseHeld, describe_holder, try_acquire
from pipeline.plan import PlannedStage, plan_stage
from pipeline.recipe import Defaults, StorageConfig
from pipeline.speed import resolve_stage_speed
from pipeline.stage_metrics import describe, headline
from pipeline.tracking import InputRef, PipelineTracker, timestamped
from stages.common import secrets
from stages.common.artifact_inputs import CHECKPOINTS, ArtifactError, StorageError, read_manifest
from stages.common.contract import NOT_INSTALLED, Launcher, RaySettings, Resources, StageJob, launch_problem
from stages.common.store_writes import WritePolicy
from stages.registry import STAGE_KINDS, StageKind

FAILED = "_FAILED"
_WAIT_POLL_S = 2.0


class StageRunning(ArtifactError):
    """Another live run executes the stage and this run was told not to wait."""

    failure_category = "busy"  # pipeline.failures: not retried


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
    headline: dict[str, list[float]] = field(default_factory=dict)  # pipeline.stage_metrics.headline
    run_link: str | None = None  # the stage's MLflow run: its UI URL, or how to open it

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
    hashed: dict[str, Any] = field(default_factory=dict)  # what the hash covers (pipeline.plan)
    inputs: dict[str, Fingerprint] = field(default_factory=dict)
    progress_deadline_s: float | None = None  # pipeline.launch stops a job silent for longer
    ray: RaySettings | None = None  # the cluster of a `launcher: ray` stage

    @classmethod
    def of(cls, stage: PlannedStage) -> "StageTarget":
        """The one way a target is made: from a planned stage (pipeline.plan.plan_stage)."""
        return cls(stage.recipe, stage.name, stage.kind, stage.resolved_config(), stage.hash, stage.url,
                   {d: (stage.upstream_urls[d], stage.upstream[d]) for d in stage.deps},
                   stage.resources, stage.launcher, stage.seed, stage.hashed, stage.inputs,
                   stage.progress_deadline_s, stage.ray)


@dataclass(frozen=True)
class ExecutionPolicy:
    """How a stage is executed, beyond what it computes (recipe `storage` settings)."""

    keep_checkpoints: int
    lease_timeout_s: float
    wait_if_running: bool = True
    flow_run_id: str | None = None
    writes: WritePolicy = WritePolicy()  # the stage job's store writes (checkpoints)

    @classmethod
    def of(cls, storage: StorageConfig, **kw: Any) -> "ExecutionPolicy":
        return cls(storage.keep_checkpoints, storage.lease_timeout_s, **kw,
                   writes=WritePolicy(storage.write_timeout_s, storage.write_attempts))


def execute(target: StageTarget, store: ArtifactStore, work_root: Path, policy: ExecutionPolicy,
            tracker: PipelineTracker | None = None, force: bool = False) -> StageRun:
    if store.is_done(target.url) and not force:
        return _skipped(target)
    for dep, (url, _) in target.upstream.items():
        if not store.is_done(url):
            raise ArtifactError(f"stage {target.name!r} needs the output of {dep!r} ({url}), which is "
                                f"not published: run {dep!r} first (drop --only)")
    lease = _acquire(target, store, policy, tracker, force)
    if lease is None:  # another run published it while we waited
        return _skipped(target)
    try:
        return _execute_leased(target, store, Path(work_root), policy, tracker, force, lease)
    finally:
        lease.release()


def _skipped(target: StageTarget) -> StageRun:
    console.current().stage_finished(target.name, f"cached    -> {target.url}")
    return StageRun(target.name, "skipped", target.url, target.hash)


def _acquire(target: StageTarget, store: ArtifactStore, policy: ExecutionPolicy,
             tracker: PipelineTracker | None, force: bool) -> Lease | None:
    """The stage's lease; None when the stage got published by another run meanwhile."""
    info = {"recipe": target.recipe, "stage": target.name, "hash": target.hash,
            "flow_run_id": policy.flow_run_id,
            "tracking_uri": tracker.uri if tracker else None,
            "parent_run_id": tracker.parent_id if tracker else None}
    waiting_since = None
    while True:
        interrupt.raise_if_stopping(f"stage {target.name!r}")
        try:
            lease = try_acquire(target.url, store.storage_options, policy.lease_timeout_s, info)
            break
        except LeaseHeld as e:
            if not policy.wait_if_running:
                raise StageRunning(f"stage {target.name!r} is running since {describe_holder(e.holder)} "
                                   f"({target.url}); wait for it, or rerun without --no-wait") from None
            if waiting_since is None:
                waiting_since = time.time()
                console.current().stage_note(target.name, f"already running since {describe_holder(e.holder)}; "
                                             "waiting for it")
        deadline = time.time() + _WAIT_POLL_S
        while time.time() < deadline:
            interrupt.raise_if_stopping(f"stage {target.name!r}")
            time.sleep(0.2)
        if store.is_done(target.url) and not force:
            return None
    if lease.taken_over:
        console.current().stage_note(target.name, "taking over from a run that stopped heartbeating "
                                     f"({describe_holder(lease.taken_over)}); it resumes from its last checkpoint")
        if tracker:
            tracker.mark_killed(lease.taken_over)
    if store.is_done(target.url) and not force:
        lease.release()
        return None
    return lease


def planned_packages(target: StageTarget) -> dict[str, str]:
    """The versions of the distributions the stage hash covers, as fingerprinted when the stage was
    planned (`target.inputs`, not this process's environment now: a long run may have upgraded one
    since), NOT_INSTALLED for one that was missing then: each rank of the job checks its own
    against them (StageJob.check_packages)."""
    return {key.removeprefix(PACKAGE_INPUT): fp.version or NOT_INSTALLED
            for key, fp in sorted(target.inputs.items()) if key.startswith(PACKAGE_INPUT)}


def _execute_leased(target: StageTarget, store: ArtifactStore, work_root: Path, policy: ExecutionPolicy,
                    tracker: PipelineTracker | None, force: bool, lease: Lease) -> StageRun:
    work = work_root.resolve() / target.recipe / f"{target.name}-{target.hash[:12]}" / lease.owner
    output_dir, scratch, log_path = work / "output", work / "scratch", work / "stage.log"
    output_dir.mkdir(parents=True)
    scratch.mkdir(parents=True)
    if force:  # a forced rerun starts fresh: no published output, no checkpoints to resume
        store.unpublish(target.url)
        store.remove(target.url, CHECKPOINTS)

    run_id = tracker.start_stage(target.name, target.kind.name, target.hash, target.config, input_refs(target),
                                 f"{target.kind.name} stage `{target.name}` -> {target.url}") if tracker else None
    run_link = tracker.run_link(run_id) if tracker and run_id else None
    lease.update(run_id=run_id, work_dir=str(work))
    speed = resolve_stage_speed(target.kind, target.config, target.resources, target.launcher, store.storage_options,
                                target.ray)
    job = StageJob(recipe=target.recipe, stage=target.name, kind=target.kind.name, hash=target.hash,
                   config=speed.apply(target.config) if speed else target.config, stage_url=target.url,
                   storage_options=store.storage_options,
                   upstream={d: u for d, (u, _) in target.upstream.items()},
                   output_dir=str(output_dir), work_dir=str(scratch),
                   tracking_uri=tracker.uri if tracker else None, run_id=run_id, seed=target.seed,
                   store_timeout_s=policy.writes.timeout_s, store_attempts=policy.writes.attempts,
                   packages=planned_packages(target))
    job_path = work / "job.json"
    job_env = secrets.job_env(job.write(job_path))  # credentials reach the job through its environment
    show = console.current()
    show.stage_started(target.name, f"{target.kind.name}, {target.launcher} on {target.resources.world_size} "
                                    "ranks" if target.kind.distributed else target.kind.name)
    if speed and speed.choices:  # `auto` speed settings decided for this machine (pipeline/speed.py)
        show.stage_note(target.name, f"speed: {speed.summary()} ({speed.hw.describe()})")
    started = time.time()
    try:
        for check in target.kind.pre_launch:  # e.g. the eval-suite gate (stages/common/eval_suite_gate.py)
            check(target.name, target.config, store.storage_options)
        command, launched = _launch(target, job_path, log_path, job_env, lease, tracked=run_id is not None)
        if lease.lost:  # lost after the job's last poll: publishing could overwrite the new holder's
            raise StageInterrupted(f"stage {target.name!r} was stopped before publishing: its lease "
                                   f"was lost: {lease.lost}")
        finished = time.time()
        secrets.scrub_files(output_dir)  # a summary or report that quotes a credential is published redacted
        (output_dir / "logs").mkdir(exist_ok=True)
        shutil.copy(log_path, output_dir / "logs" / "stage.log")
        summary_path = output_dir / "stage_summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        manifest = {
            "recipe": target.recipe, "stage": target.name, "kind": target.kind.name,
            "hash": target.hash, "config": target.config,
            "upstream": {d: h for d, (_, h) in target.upstream.items()},
            "hashed": target.hashed, "inputs": {k: fp.as_dict() for k, fp in target.inputs.items()},
            "code": code_record(target.kind), "attempt": lease.owner, "mlflow_run_id": run_id,
            "timings": {"started": started, "finished": finished, "seconds": finished - started},
            "command": command, "summary": summary,
            "resolved_speed": speed.record() if speed else None,
        }
        store.publish(output_dir, target.url, manifest)
    except BaseException as e:
        failure = StageFailure.of(target.name, e, log=str(log_path), run_id=run_id, run_link=run_link,
                                  attempt=lease.owner)
        e.failure = failure  # type: ignore[attr-defined] - read by pipeline.flow, pickled along with e
        _record_failure(store, target, failure)
        show.stage_failed(target.name, f"after {time.time() - started:.1f}s, " + failure.report(), failure.verdict)
        if tracker and run_id:
            tracker.end_stage_quietly(run_id, "KILLED" if failure.interrupted else "FAILED", [log_path])
        raise
    try:
        store.prune_checkpoints(target.url, policy.keep_checkpoints)
        store.remove(target.url, FAILED)
    except StorageError as e:  # the artifact is published; leftovers are for `gc`
        show.stage_note(target.name, f"warning: {e}")
    numbers = headline(target.kind.name, launched.output.first, launched.output.last)
    if tracker and run_id:
        _plot(tracker, run_id, target)
        tracker.end_stage(run_id, "FINISHED", [log_path, *([summary_path] if summary else [])])
    show.stage_finished(target.name, "  ".join(p for p in (f"done in {finished - started:.1f}s", describe(numbers),
                                                            f"-> {target.url}") if p))
    return StageRun(target.name, "ran", target.url, target.hash, finished - started, run_id, summary, numbers,
                    run_link)


def _launch(target: StageTarget, job_path: Path, log_path: Path, job_env: dict[str, str],
            lease: Lease, tracked: bool) -> tuple[list[str], LaunchResult]:
    """The job's command and its run; its rendezvous port stays reserved until the job ended."""
    with launch_command(target.kind.entry, job_path, target.resources, target.launcher,
                        target.kind.distributed, target.ray) as command:
        return command, launch_job(command, target.name, log_path, target.resources, kind=target.kind.name,
                                   extra_env=job_env, progress_deadline_s=target.progress_deadline_s, tracked=tracked,
                                   must_stop=lambda: lease.lost and f"its {target.url}/_RUNNING lease was "
                                                                    f"lost: {lease.lost}")


def _plot(tracker: PipelineTracker, run_id: str, target: StageTarget) -> None:
    """The stage's main curves as PNGs in its MLflow run; a plot that fails is not the
    stage's failure (its artifact is published)."""
    try:
        tracker.plot_main_curves(run_id, target.kind.name, target.name)
    except Exception as e:  # noqa: BLE001 - matplotlib or the tracking store; the stage is done
        console.current().stage_note(target.name, f"warning: no plots of its curves: {type(e).__name__}: {e}")


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(key path, value) of every string in a config, e.g. (`tokenizer.corpus[0]`, url)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def input_refs(target: StageTarget) -> list[InputRef]:
    """The stage's inputs for MLflow: what it reads of upstream artifacts (with their hash)
    and its external inputs (with their content fingerprint)."""
    refs = []
    for key, value in _strings(target.config):
        if value in target.inputs:
            fp = target.inputs[value]
            refs.append(InputRef(value.rstrip("/").rsplit("/", 1)[-1], value, fp.digest, "external", key, fp.summary))
            continue
        for dep, (url, h) in target.upstream.items():
            if value == url or value.startswith(url.rstrip("/") + "/"):
                name = dep + value[len(url.rstrip("/")):]
                refs.append(InputRef(name, value, h, "upstream", key, f"output of stage {dep}"))
                break
    return refs


def _record_failure(store: ArtifactStore, target: StageTarget, failure: StageFailure) -> None:
    """A `_FAILED` note next to the stage's outputs, for `ring-pipeline status`."""
    try:
        store.write_note(target.url, FAILED, failure.as_note())
    except StorageError:  # the original error matters more than the note
        pass


def read_failure(store: ArtifactStore, url: str) -> dict | None:
    return store.read_note(url, FAILED)


def adhoc_target(kind: str, config: dict[str, Any], *, stage: str, storage: str,
                 upstream: dict[str, str] | None = None, resources: Resources | None = None,
                 launcher: Launcher = "deepspeed", recipe: str = "adhoc",
                 storage_options: dict[str, Any] | None = None, seed: int = 0) -> StageTarget:
    """The stage `run_stage` executes (its hash and artifact URL), without running it.

    `upstream` maps the stage names used in `${stages.NAME.output}` references to
    published artifact URLs; their hashes come from their manifests.
    """
    spec = STAGE_KINDS[kind]
    cfg = spec.config.model_validate({"kind": kind, **config})
    resources, launcher = resources or cfg.resources or Resources(), cfg.launcher or launcher
    problem = launch_problem(resources, launcher) if spec.distributed else None
    if problem:
        raise ValueError(f"stage {stage!r}: {problem}")
    opts = storage_options or {}
    up = {n: (u, read_manifest(u, opts)["hash"])
          for n, u in ((n, normalise_url(u)) for n, u in (upstream or {}).items())}
    deadline_min = cfg.progress_deadline_min or (Defaults().progress_deadline_min if spec.distributed else None)
    return StageTarget.of(plan_stage(recipe, stage, cfg, up, ArtifactStore(join(storage, recipe), opts),
                                     resources, launcher, seed, Defaults().input_hash_max_bytes,
                                     progress_deadline_s=deadline_min * 60 if deadline_min else None,
                                     ray=cfg.ray))


def run_stage(kind: str, config: dict[str, Any], *, stage: str, storage: str,
              upstream: dict[str, str] | None = None, resources: Resources | None = None,
              launcher: Launcher = "deepspeed", recipe: str = "adhoc",
              storage_options: dict[str, Any] | None = None, tracking_uri: str | None = None,
              experiment: str = "adhoc", work_root: Path = Path(".ring/work"), seed: int = 0,
              force: bool = False, writes: WritePolicy = WritePolicy()) -> StageRun:
    """One stage without a recipe or Prefect (tests, benchmarks, debugging); see `adhoc_target`.
    `writes` bounds each store write (storage.write_timeout_s / write_attempts)."""
    opts = storage_options or {}
    target = adhoc_target(kind, config, stage=stage, storage=storage, upstream=upstream,
                          resources=resources, launcher=launcher, recipe=recipe,
                          storage_options=opts, seed=seed)
    store = ArtifactStore(join(storage, recipe), opts, writes)
    tracker = PipelineTracker(tracking_uri, experiment, timestamped(recipe), {},
                              tags={"ring.recipe": recipe}) if tracking_uri else None
    policy = ExecutionPolicy.of(StorageConfig(url=storage, options=opts, write_timeout_s=writes.timeout_s,
                                              write_attempts=writes.attempts))
    try:
        result = execute(target, store, work_root, policy, tracker, force)
    except BaseException:
        if tracker:
            tracker.end("FAILED")
        raise
    if tracker:
        tracker.end("FINISHED")
    return result
