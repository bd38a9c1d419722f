"""MLflow: one parent run per pipeline run, one nested run per stage.

The pipeline process opens the runs; a stage's own processes log into their stage run
by id (`stages.common.stage_log.StageLogger`), rank 0 only, so no process needs an
active-run context.

A parent run is named `{recipe} {time}` (the Prefect flow run has the same name), carries
the recipe's description, the git commit and the recipe as given and as resolved, and
links to its Prefect flow run. A stage run records its input datasets with their URLs and,
when it ends, plots of its main curves (pipeline.plots). An experiment this module creates
keeps its artifacts next to a SQLite tracking DB (`.ring/mlartifacts`), not in `./mlruns`
of whatever directory a run started in, and opens on its runs in the MLflow UI.

Two runs may share one SQLite tracking DB: creating its tables and the experiment is done
under a lock file next to the DB (two runs starting at once raced there).
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, Iterator

from pipeline.changes import git_commit
from pipeline.plots import log_main_curves
from stages.common import secrets
from stages.common.stage_log import flatten, mlflow_client

_MAX_TAG = 5000  # and a tag value's (mlflow.note.content included)
# MLflow 3's UI opens an experiment without this tag on its GenAI overview
_EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


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


def default_artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a SQLite DB; elsewhere (a tracking
    server, a file store) where the store puts them."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
    return None


def timestamped(name: str, when: float | None = None) -> str:
    """`tiny 2026-11-26 10:35:55`: how runs of a recipe are told apart (Prefect and MLflow)."""
    return f"{name} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))}"


@dataclass(frozen=True)
class InputRef:
    """A stage input to record as an MLflow dataset input."""

    name: str  # `data/sft.jsonl` (an upstream stage's output) or the file's name: with the
    # digest, what MLflow tells datasets apart by
    url: str
    digest: str  # its upstream artifact's hash or its content fingerprint
    context: str  # "upstream" (another stage's artifact) or "external"
    key: str  # where the stage config names it, e.g. `tokenizer.corpus[0]`
    summary: str = ""


def _dataset_input(ref: InputRef):
    from mlflow.entities import Dataset, DatasetInput, InputTag

    scheme = ref.url.split("://", 1)[0] if "://" in ref.url else "local"
    source = json.dumps({"uri": ref.url if "://" in ref.url else Path(ref.url).resolve().as_uri()})
    profile = json.dumps({"summary": ref.summary}) if ref.summary else None
    return DatasetInput(Dataset(ref.name, ref.digest[:12], "local" if scheme == "file" else scheme, source,
                                profile=profile),
                        [InputTag("mlflow.data.context", ref.context), InputTag("ring.config_key", ref.key)])


def _described(tags: dict[str, str], description: str) -> dict[str, str]:
    """`tags` plus the run's description (shown atop its page) and the code's git commit."""
    out = secrets.public(dict(tags))  # never a credential (stages.common.secrets)
    if description:
        out["mlflow.note.content"] = secrets.redact(description)[:_MAX_TAG]
    commit = git_commit()
    if commit:
        out["mlflow.source.git.commit"] = commit
    return out


class PipelineTracker:
    """Opened by the pipeline process: the parent run and the per-stage nested runs.

    Prefect tasks may run in other threads or processes: they `attach` by handle.
    """

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, Any], *,
                 description: str = "", tags: dict[str, str] | None = None,
                 artifact_location: str | None = None, ui_url: str | None = None):
        self.uri, self.ui_url = uri, _ui_url(uri, ui_url)
        with _setup_lock(uri):
            self.client = mlflow_client(uri)
            exp = self.client.get_experiment_by_name(experiment)
            self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
                experiment, artifact_location=artifact_location or default_artifact_location(uri),
                tags=_EXPERIMENT_KIND)
        run = self.client.create_run(self.experiment_id, run_name=secrets.redact(run_name),
                                     tags=_described({"ring.kind": "pipeline", **(tags or {})}, description))
        self.parent_id = run.info.run_id
        self._log_params(self.parent_id, params)

    def handle(self) -> dict[str, str | None]:
        """What a Prefect task needs to attach (a task parameter: any credential in the tracking
        URI is its `${env:}` reference, resolved by the task with `secrets.resolve`)."""
        return secrets.for_job({"uri": self.uri, "experiment_id": self.experiment_id, "parent_id": self.parent_id,
                                "ui_url": self.ui_url})

    @classmethod
    def attach(cls, uri: str, experiment_id: str, parent_id: str, ui_url: str | None = None) -> "PipelineTracker":
        self = cls.__new__(cls)
        self.uri, self.experiment_id, self.parent_id = uri, experiment_id, parent_id
        self.ui_url = _ui_url(uri, ui_url)
        self.client = mlflow_client(uri)
        return self

    def run_url(self, run_id: str) -> str | None:
        """The run's page in the MLflow UI, when the UI's address is known."""
        if not self.ui_url:
            return None
        return secrets.redact(f"{self.ui_url}/#/experiments/{self.experiment_id}/runs/{run_id}")

    def run_link(self, run_id: str) -> str:
        """The run's page, or how to open it (`mlflow ui` on a local tracking store)."""
        return self.run_url(run_id) or secrets.redact(f"{run_id} (open with: mlflow ui --backend-store-uri {self.uri})")

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flatten(secrets.public(params)).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def attach_text(self, text: str, name: str, run_id: str | None = None) -> None:
        """A text file among the run's artifacts (the recipe, as given and as resolved)."""
        self.client.log_text(run_id or self.parent_id, secrets.redact(text), name)

    def start_stage(self, stage: str, kind: str, stage_hash: str, config: dict[str, Any],
                    inputs: list[InputRef] = (), description: str = "") -> str:
        tags = {"mlflow.parentRunId": self.parent_id, "ring.stage": stage, "ring.kind": kind, "ring.hash": stage_hash}
        run = self.client.create_run(self.experiment_id, run_name=stage, tags=_described(tags, description))
        self._log_params(run.info.run_id, config)
        if inputs:
            self._log_inputs(run.info.run_id, inputs)
        return run.info.run_id

    def _log_inputs(self, run_id: str, inputs: list[InputRef]) -> None:
        """Dataset inputs: bookkeeping, never a reason for the stage to fail. Serialised: two
        stages recording one dataset at once collide in MLflow's get-or-create."""
        try:
            with _setup_lock(self.uri):
                self.client.log_inputs(run_id, datasets=[_dataset_input(InputRef(*secrets.public(list(astuple(r)))))
                                                         for r in inputs])
        except Exception as e:  # noqa: BLE001
            print(f"warning: could not record the input datasets of MLflow run {run_id}: {e}",
                  file=sys.stderr, flush=True)

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

    def plot_main_curves(self, run_id: str, kind: str, stage: str) -> str | None:
        """PNG plots of the stage's main curves among its run's artifacts (pipeline.plots)."""
        return log_main_curves(self.client, run_id, kind, stage)

    def mark_killed(self, holder: dict[str, Any]) -> None:
        """The MLflow runs of a dead executor whose stage lease was taken over: KILLED, not
        RUNNING forever (when they live in this tracking store)."""
        if holder.get("tracking_uri") not in (self.uri, secrets.redact(self.uri)):  # notes hold it redacted
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

    def discard(self) -> None:
        """A run in which nothing ran (every stage published already) leaves no parent run
        behind: deleted (MLflow keeps it in its trash until `mlflow gc`)."""
        self.client.set_terminated(self.parent_id, "FINISHED")
        self.client.delete_run(self.parent_id)


def _ui_url(uri: str, ui_url: str | None) -> str | None:
    """The MLflow UI's address: given, or the tracking server's own."""
    if ui_url:
        return ui_url.rstrip("/")
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else None
