"""What a stage job reports, from rank 0: metrics per step, progress, params and artifacts
into its MLflow run (by id: no active-run context), and the same metrics and progress as
stdout lines, the protocol the pipeline reads (pipeline/job_output.py).
"""
from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from stages.common import secrets

MAX_PARAM = 500  # MLflow's limit on a param value's length
# metric batches handed to the sender and not yet sent: past this many, `metrics` waits, so a tracking
# server that fails or falls behind stops the stage within a few logged steps
METRICS_IN_FLIGHT = 8
# the metric senders handed batches since the last `flush_all`, what it waits for: a logger may be gone
# (one per model in eval, made inside a function) while its sender still holds batches
_SENDERS: "list[MetricSender]" = []
# the stdout protocol: `[metrics] {"step": N, ...}` and `[progress] {"done": N, "total": T, "unit": u}`
METRICS_MARKER = "[metrics] "
PROGRESS_MARKER = "[progress] "
HEARTBEAT_MARKER = "[heartbeat]"  # alive inside a long step: resets the progress deadline (pipeline.hang)


def mlflow_client(uri: str):
    """An MLflow client of `uri`, creating a local store's directory first."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    elif uri.startswith("file:") or "://" not in uri:
        Path(uri.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            s = json.dumps(v) if not isinstance(v, str) else v
            out[key] = s if len(s) <= MAX_PARAM else s[: MAX_PARAM - 3] + "..."
    return out


class StageLogger:
    """Used inside a stage's processes: metrics per step, progress and artifacts, from rank 0.

    Metrics and progress also go to stdout, one line each (`[metrics] {...}`, `[progress]
    {...}`: the protocol pipeline/job_output.py reads), which the pipeline saves in the stage's
    log and turns into the console's progress line. A stage declares its total once at its
    start, `log.progress(start_step, total=steps)`; each `metrics(step, ...)` then moves the
    progress to `step`. A stage without per-step metrics (curation steps, generated files)
    calls `progress(done)` as it goes.
    """

    def __init__(self, tracking_uri: str | None, run_id: str | None, rank: int = 0):
        self.enabled = rank == 0
        self.run_id = run_id
        self.client = mlflow_client(tracking_uri) if self.talks_to_mlflow(tracking_uri, run_id, rank) else None
        self._sender: MetricSender | None = None  # started with the first metrics sent to MLflow

    @staticmethod
    def talks_to_mlflow(tracking_uri: str | None, run_id: str | None, rank: int) -> bool:
        """Whether the stage process of this rank logs to MLflow (rank 0 of a tracked run)."""
        return rank == 0 and bool(tracking_uri and run_id)

    @classmethod
    def for_job(cls, job) -> "StageLogger":
        return cls(job.tracking_uri, job.run_id, job.rank)

    def metrics(self, step: int, values: dict[str, float],
                mlflow_name: Callable[[str], str] | None = None) -> None:
        """One step's metrics: a `[metrics]` line with their names, and MLflow, where
        `mlflow_name` may file each under a section (`group/name`)."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items()
                 if v is not None and math.isfinite(float(v))}
        print(METRICS_MARKER + json.dumps({"step": step, **clean}), flush=True)
        if self.client:
            from mlflow.entities import Metric

            ts = int(time.time() * 1000)
            name = mlflow_name or (lambda k: k)
            if self._sender is None:
                self._sender = MetricSender(self.client, self.run_id)
            # a training step no longer waits for the server's round trip (the GPU idled through it,
            # after the step's closing sync)
            self._sender.send([Metric(name(k), v, ts, step) for k, v in clean.items()])

    def flush(self) -> None:
        """Wait until MLflow has every metric batch sent so far (raises its error if one failed)."""
        if self._sender is not None:
            self._sender.flush()

    def progress(self, done: int, total: int | None = None, unit: str | None = None) -> None:
        """How far the stage is: `done` units of `total` (say the total once, at the start;
        `unit` names what is counted, "step" unless said)."""
        if not self.enabled:
            return
        line = {"done": int(done), **({"total": int(total)} if total is not None else {}),
                **({"unit": unit} if unit else {})}
        print(PROGRESS_MARKER + json.dumps(line), flush=True)

    def heartbeat(self, what: str = "") -> None:
        """Alive inside a long step (call it from the main loop, never a timer thread: a rank
        blocked in a collective must stop heartbeating): resets the stage's progress deadline."""
        if self.enabled:
            print(f"{HEARTBEAT_MARKER} {what}".rstrip(), flush=True)

    # what goes to MLflow never holds a credential of the job (stages.common.secrets)
    def params(self, values: dict[str, Any]) -> None:
        if self.enabled and self.client:
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in flatten(secrets.public(values)).items()])

    def artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.enabled and self.client:
            secrets.scrub_files(path)  # a report may quote an input's URL
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def text(self, text: str, name: str) -> None:
        if self.enabled and self.client:
            self.client.log_text(self.run_id, secrets.redact(text), name)


class MetricSender:
    """Metric batches sent to one MLflow run, in order, by a daemon thread. `send` returns at once
    unless METRICS_IN_FLIGHT batches still wait; a failed send is raised by every later `send` and
    `flush`. Not MLflow's own async logging (`log_batch(synchronous=False)`): its logging thread
    polls with a 1 s timeout that its exit hook joins, ~1 s more at every tracked process's exit."""

    def __init__(self, client: Any, run_id: str):
        self.client, self.run_id = client, run_id
        self._queue: queue.Queue = queue.Queue(maxsize=METRICS_IN_FLIGHT)
        self._error: Exception | None = None
        threading.Thread(target=self._send_forever, name="mlflow-metrics", daemon=True).start()

    def _send_forever(self) -> None:
        while True:
            metrics = self._queue.get()
            try:
                if self._error is None:  # after a failure nothing more goes out: the stage is failing
                    self.client.log_batch(self.run_id, metrics=metrics)
            except Exception as e:
                self._error = e
            finally:
                self._queue.task_done()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def send(self, metrics: list[Any]) -> None:
        self._raise_failure()
        if self not in _SENDERS:
            _SENDERS.append(self)
        self._queue.put(metrics)  # waits while METRICS_IN_FLIGHT batches are unsent

    def flush(self) -> None:
        self._queue.join()
        self._raise_failure()


def flush_all() -> None:
    """Every metric sender of this process flushed (stages/common/entry.py, as a job ends: the sender
    threads are daemons, so whatever they still hold at exit would be lost), its logger kept or not.
    Each is forgotten once flushed: a process that runs several jobs (a test's in-process ones)
    neither keeps them all nor meets an earlier job's tracking failure again."""
    while _SENDERS:
        _SENDERS.pop(0).flush()


def info(msg: str) -> None:
    """Progress line from a stage process (rank-prefixing is done by the launcher)."""
    print(msg, file=sys.stdout, flush=True)
