"""The state of a planned stage as its store records it, for `ring-pipeline status`.

- running: a live `_RUNNING` lease (a stage being forced to rerun shows running too);
- done: `_SUCCESS` (with a warning when the code that made it drifted);
- failed / interrupted: the `_FAILED` note of the latest attempt (what failed, the stage log,
  the MLflow run: pipeline.failures), or a lease whose heartbeat stopped (its run was
  killed: a later run takes it over and resumes);
- pending: nothing yet;
- error: the store could not answer (outage, permissions, a corrupt manifest): never a crash.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeline.artifacts import ArtifactStore
from pipeline.changes import code_drift
from pipeline.execute import read_failure
from pipeline.failures import StageFailure
from pipeline.lease import describe_holder, is_live, read_lease
from pipeline.plan import PlannedStage
from stages.common.artifact_inputs import ArtifactError


@dataclass
class StageState:
    state: str
    run_id: str | None = None
    detail: str | None = None
    warnings: list[str] = field(default_factory=list)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def stage_state(store: ArtifactStore, stage: PlannedStage) -> StageState:
    try:
        lease = read_lease(stage.url, store.storage_options)
        if lease is not None and is_live(lease):
            return StageState("running", lease.get("run_id"), f"since {describe_holder(lease)}")
        if store.is_done(stage.url):
            manifest = store.read_manifest(stage.url)
            drift = code_drift(stage.name, stage.kind, manifest)
            return StageState("done", manifest.get("mlflow_run_id"), None, [drift] if drift else [])
        failure = read_failure(store, stage.url)
        if lease is not None and (failure is None or failure.get("time", 0) < lease.get("heartbeat", 0)):
            return StageState("interrupted", lease.get("run_id"),
                              f"its run stopped heartbeating at {_when(float(lease.get('heartbeat', 0)))} "
                              f"(started {describe_holder(lease)}); a new run takes over and resumes")
        if failure is not None:
            state = "interrupted" if failure.get("interrupted") else "failed"
            report = StageFailure.from_note(stage.name, failure).report()
            return StageState(state, failure.get("run_id"), f"{_when(float(failure.get('time', 0)))}: {report}")
        return StageState("pending")
    except ArtifactError as e:
        return StageState("error", None, str(e))
