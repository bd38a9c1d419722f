"""`ring-pipeline run` as a process: where the flow runs, who hears signals, what is left.

- The flow runs in a worker thread and the main thread only waits for it, so the SIGINT /
  SIGTERM handlers of `pipeline.interrupt` run at once (Prefect's own SIGTERM bridge, which
  a flow run installs only on the main thread, stays out of the way) and every stage job is
  stopped by the thread that waits on it.
- Without PREFECT_API_URL the run talks to the embedded server of `pipeline.prefect_server`,
  stopped last.
- Against a Prefect server the run is a flow run of the recipe's deployment
  (`ring-pipeline/<recipe name>`, the one `ring-pipeline serve` serves), so a failed run
  can be retried from the Prefect UI: the retry runs wherever that deployment is served.
- The console is pipeline.console's: Prefect's own console log lines of flow and task runs
  (and MLflow's set-up chatter) are shown only when verbose; they still reach the Prefect UI.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import interrupt
from pipeline.console import Verbosity
from pipeline.prefect_server import embedded_prefect_api
from stages.common import secrets
from stages.common.artifact_inputs import ArtifactError
from stages.common.contract import StageFailed

_AFTER_STOP_WAIT_S = 60.0  # the flow thread's time to record a stop before we exit anyway


@dataclass
class RunOutcome:
    results: dict[str, Any] | None = None
    error: BaseException | None = None
    interrupted: str | None = None  # the signal's name
    exit_code: int = 0  # when interrupted: 130 (SIGINT) or 143 (SIGTERM)
    flow_run_id: str | None = None
    deployment: str | None = None  # "flow/deployment" when the run belongs to one
    verbosity: Verbosity = Verbosity.NORMAL


def run_recipe(params: dict[str, Any], deployment_name: str, work_dir: Path,
               verbosity: Verbosity = Verbosity.NORMAL) -> RunOutcome:
    """Run `pipeline_flow(**params)` to its end or until a signal stops it."""
    outcome = RunOutcome(verbosity=verbosity)
    user_api = os.environ.get("PREFECT_API_URL")
    with interrupt.signals_stop_the_run():
        if user_api:
            api_context: contextlib.AbstractContextManager[str] = contextlib.nullcontext(user_api)
        else:
            api_context = embedded_prefect_api(work_dir / f"prefect-server-{os.getpid()}.log")
        with api_context as api:
            if not interrupt.stop_requested():
                worker = threading.Thread(target=_run_flow, name="ring-pipeline flow", daemon=True,
                                          args=(params, api, deployment_name if user_api else None, outcome))
                worker.start()
                _wait_for(worker)
                _drain_prefect_workers()
        outcome.interrupted = interrupt.stop_requested()
        outcome.exit_code = interrupt.exit_code() if outcome.interrupted else 0
    return outcome


def _drain_prefect_workers() -> None:
    """Send Prefect's queued logs and events while the server still runs: drained at exit
    instead, they retried against the stopped embedded server for more than a minute."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


def _wait_for(worker: threading.Thread) -> None:
    while worker.is_alive() and not interrupt.stop_requested():
        worker.join(0.2)
    worker.join(_AFTER_STOP_WAIT_S)


class _PrefectConsoleFilter(logging.Filter):
    """Prefect's console lines. Verbose: all, but a failed task or flow without the traceback
    when the message is the whole story (a failed stage job, a store error, a stop). Otherwise
    none of the flow and task run lines: pipeline.console says what happened to each stage."""

    def __init__(self, verbosity: Verbosity):
        super().__init__()
        self.verbosity = verbosity

    def filter(self, record: logging.LogRecord) -> bool:
        from pipeline.flow import PipelineFailed  # imports Prefect: not before a run needs it

        if self.verbosity < Verbosity.VERBOSE and record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return False
        if record.exc_info and isinstance(record.exc_info[1], (StageFailed, ArtifactError, PipelineFailed,
                                                              interrupt.StageInterrupted)):
            record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def _console_logging(verbosity: Verbosity) -> Any:
    from prefect.logging.handlers import APILogHandler

    names = [n for n in logging.root.manager.loggerDict if n.startswith("prefect")]
    handlers = {h for n in (None, *names) for h in logging.getLogger(n).handlers
                if not isinstance(h, APILogHandler)}  # the Prefect UI gets every line
    quiet = _PrefectConsoleFilter(verbosity)
    for h in handlers:
        h.addFilter(quiet)
    every = {h for n in (None, *names) for h in logging.getLogger(n).handlers}  # the Prefect API's too
    redacting = secrets.RedactingFilter()
    for h in every:
        h.addFilter(redacting)
    import mlflow  # noqa: F401 - configures its loggers on import: before ours is set below

    mlflow_logger = logging.getLogger("mlflow")
    mlflow_level = mlflow_logger.level
    if verbosity < Verbosity.VERBOSE:
        mlflow_logger.setLevel(logging.WARNING)  # "Creating initial MLflow database tables..."
    try:
        yield
    finally:
        mlflow_logger.setLevel(mlflow_level)
        for h in handlers:
            h.removeFilter(quiet)
        for h in every:
            h.removeFilter(redacting)


def _run_flow(params: dict[str, Any], api: str, deployment_name: str | None, outcome: RunOutcome) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipeline.flow import pipeline_flow  # imports Prefect: not before a run needs it

    try:
        with temporary_settings(updates={PREFECT_API_URL: api}), _console_logging(outcome.verbosity):
            if deployment_name:
                outcome.results = _run_as_deployment(pipeline_flow, params, deployment_name, outcome)
            else:
                outcome.results = pipeline_flow(**params)
    except BaseException as e:  # noqa: BLE001 - handed to the main thread
        outcome.error = e


def _run_as_deployment(flow: Any, params: dict[str, Any], name: str, outcome: RunOutcome) -> dict[str, Any]:
    """Register the recipe's deployment and run one of its flow runs here, in this process.

    The flow run is created Pending, not Scheduled: a `serve` process of the same deployment
    picks up only scheduled runs, so it cannot start this one a second time."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow
    from prefect.states import Pending

    deployment = flow.to_deployment(name=name, parameters={"recipe_path": params["recipe_path"],
                                                           "overrides": params["overrides"]})
    deployment_id = deployment.apply()
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(deployment_id, parameters=params, state=Pending())
    outcome.flow_run_id, outcome.deployment = str(flow_run.id), f"{flow.name}/{name}"
    return run_flow(flow, flow_run=flow_run, parameters=params)
