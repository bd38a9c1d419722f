"""MLflow: one parent run per pipeline run, one nested run per stage.

The pipeline process opens the runs; a stage's own processes log into their stage run
by id (`StageLogger`), rank 0 only, so no process needs an active-run context.

Two runs may share one SQLite tracking DB: creating its tables and the experiment is done
under a lock file next to the DB (two runs starting at once raced there).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterator

_MAX_PARAM = 500  # MLflow's limit on a param value's length


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    elif uri.startswith("file:") or "://" not in uri:
        Path(uri.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


@contextlib.contextmanager
def _setup_lock(uri: str) -> Iterator[None]:
    """Serialises DB creation and experiment creation of processes sharing a SQLite file."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    from filelock import FileLock

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db) + ".lock"):
        yield


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            s = json.dumps(v) if not isinstance(v, str) else v
            out[key] = s if len(s) <= _MAX_PARAM else s[: _MAX_PARAM - 3] + "..."
    return out


class PipelineTracker:
    """Opened by the pipeline process: the parent run and the per-stage nested runs.

    Prefect tasks may run in other threads or processes: they `attach` by handle.
    """

    def __init__(self, uri: str, experiment: str, recipe_name: str, params: dict[str, Any]):
        self.uri = uri
        with _setup_lock(uri):
            self.client = _client(uri)
            exp = self.client.get_experiment_by_name(experiment)
            self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        run = self.client.create_run(self.experiment_id, run_name=recipe_name,
                                     tags={"ring.recipe": recipe_name, "ring.kind": "pipeline"})
        self.parent_id = run.info.run_id
        self._log_params(self.parent_id, params)

    def handle(self) -> dict[str, str]:
        return {"uri": self.uri, "experiment_id": self.experiment_id, "parent_id": self.parent_id}

    @classmethod
    def attach(cls, uri: str, experiment_id: str, parent_id: str) -> "PipelineTracker":
        self = cls.__new__(cls)
        self.uri, self.experiment_id, self.parent_id = uri, experiment_id, parent_id
        self.client = _client(uri)
        return self

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def start_stage(self, stage: str, kind: str, stage_hash: str, config: dict[str, Any]) -> str:
        run = self.client.create_run(
            self.experiment_id, run_name=stage,
            tags={"mlflow.parentRunId": self.parent_id, "ring.stage": stage,
                  "ring.kind": kind, "ring.hash": stage_hash})
        self._log_params(run.info.run_id, config)
        return run.info.run_id

    def end_stage(self, run_id: str, status: str, artifacts: list[Path] = ()) -> None:
        for p in artifacts:
            if Path(p).exists():
                self.client.log_artifact(run_id, str(p))
        self.client.set_terminated(run_id, status)

    def end_stage_quietly(self, run_id: str, status: str, artifacts: list[Path] = ()) -> None:
        """end_stage on a failure path: a tracking outage must not hide the stage's own error."""
        try:
            self.end_stage(run_id, status, artifacts)
        except Exception as e:  # noqa: BLE001
            print(f"warning: could not mark MLflow run {run_id} {status}: {e}", file=sys.stderr, flush=True)

    def mark_killed(self, holder: dict[str, Any]) -> None:
        """The MLflow runs of a dead executor whose stage lease was taken over: KILLED, not
        RUNNING forever (when they live in this tracking store)."""
        if holder.get("tracking_uri") != self.uri:
            return
        for run_id in (holder.get("run_id"), holder.get("parent_run_id")):
            if not run_id:
                continue
            try:
                if self.client.get_run(run_id).info.status == "RUNNING":
                    self.client.set_terminated(run_id, "KILLED")
            except Exception as e:  # noqa: BLE001 - a bookkeeping fix, never a reason to fail
                print(f"warning: could not mark MLflow run {run_id} KILLED: {e}", file=sys.stderr, flush=True)

    def tag_stage_skipped(self, stage: str, stage_hash: str, artifact_url: str) -> None:
        self.client.set_tag(self.parent_id, f"ring.skipped.{stage}", artifact_url)

    def end(self, status: str) -> None:
        self.client.set_terminated(self.parent_id, status)


class StageLogger:
    """Used inside a stage's processes: metrics per step and artifacts, from rank 0.

    Metrics also go to stdout as one JSON line each (`[metrics] {...}`), which the
    launcher streams to the console and saves in the stage's log.
    """

    def __init__(self, tracking_uri: str | None, run_id: str | None, rank: int = 0):
        self.enabled = rank == 0
        self.run_id = run_id
        self.client = _client(tracking_uri) if (self.enabled and tracking_uri and run_id) else None

    @classmethod
    def for_job(cls, job) -> "StageLogger":
        return cls(job.tracking_uri, job.run_id, job.rank)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items()
                 if v is not None and math.isfinite(float(v))}
        print("[metrics] " + json.dumps({"step": step, **clean}), flush=True)
        if self.client:
            from mlflow.entities import Metric
            import time

            ts = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v in clean.items()])

    def params(self, values: dict[str, Any]) -> None:
        if self.enabled and self.client:
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in flatten(values).items()])

    def artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.enabled and self.client:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def text(self, text: str, name: str) -> None:
        if self.enabled and self.client:
            self.client.log_text(self.run_id, text, name)


def info(msg: str) -> None:
    """Progress line from a stage process (rank-prefixing is done by the launcher)."""
    print(msg, file=sys.stdout, flush=True)
