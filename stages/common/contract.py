"""The contract between the pipeline and a stage kind (the layer below `pipeline/`: it imports
nothing of it).

A stage kind is a pydantic config model (subclass of `StageConfig`) plus its job module
`stages/<kind>/job.py`, run as `python -m stages.<kind>.job --job job.json` (see
stages/registry.py and stages/common/entry.py). The job file is a `StageJob`: the resolved
config, where the stage's artifact lives, where to write the outputs that the pipeline
publishes, and which MLflow run to log to. A job reports a problem the user can fix by
raising `StageError`; the pipeline reports a stage that did not finish as `StageFailed`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from data_curation.benchmarks import EvalSuite
from stages.common import secrets
from stages.common.artifact_inputs import ArtifactError, fetch_input
from stages.common.ray_address import check_address


class StageFailed(RuntimeError):
    """A stage did not finish: its job exited non-zero, or a check refused to start it.

    `str()` is one line (Prefect shows it as the task's state message); `reason` is the
    whole explanation (a user error's message may span lines), `excerpt` the log lines that
    explain a crash, `user_error` whether the user can fix it (nothing to retry)."""

    def __init__(self, reason: str, *, stage: str | None = None, exit_code: int | None = None,
                 excerpt: list[str] | None = None, user_error: bool = True, log_path: Path | None = None):
        self.reason, self.stage, self.exit_code = reason, stage, exit_code
        self.excerpt, self.user_error, self.log_path = list(excerpt or []), user_error, log_path
        lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
        one_line = " / ".join(lines)
        super().__init__(f"stage {stage!r} failed: {one_line}" if stage else one_line)


class StageError(RuntimeError):
    """A problem the user can fix (data, model, config, inputs), raised inside a stage job: the
    job prints its message once, without a traceback, and exits 2. Every stage raises this type
    (or a subclass) for user errors; anything else is a bug and keeps its traceback."""


# StageJob.packages' version of a distribution the stage hash covers that was not installed where
# the stage was planned: a rank that has it would publish rows the hash does not describe
NOT_INSTALLED = "not installed"

# `${stages.NAME.output}` optionally followed by `/sub/path`
REFERENCE_RE = re.compile(r"^\$\{stages\.([A-Za-z_][A-Za-z0-9_-]*)\.output\}(/.*)?$")


def cosmetic(default: Any = None, **kw: Any) -> Any:
    """A field that does not change results (log interval, ...): kept out of the stage hash."""
    extra = dict(kw.pop("json_schema_extra", None) or {})
    extra["cosmetic"] = True
    return Field(default, json_schema_extra=extra, **kw)


def added_later(default: Any = None, **kw: Any) -> Any:
    """A field added to an existing kind whose default keeps the old behaviour: at its default
    it stays out of the stage hash (configs written before it keep their hashes); set to
    anything else, it is hashed like every field."""
    extra = dict(kw.pop("json_schema_extra", None) or {})
    extra["hash_unless_default"] = True
    return Field(default, json_schema_extra=extra, **kw)


AUTO_LEGACY = "auto_hashes_as"


def auto_setting(legacy: Any, *, added_later: bool = False, **kw: Any) -> Any:
    """A speed setting whose default became `auto` (stages/common/speed_defaults.py decides it
    before launch). At `auto` it hashes as `legacy`, the default it had before, so configs written
    before it keep their stage hashes; the value it resolves to is not hashed (like `resources`:
    it follows the hardware). `added_later`: the setting was an `added_later` field before it
    became `auto`, kept out of the hash at its old default: at `auto` or at `legacy` it still is."""
    extra = dict(kw.pop("json_schema_extra", None) or {})
    extra[AUTO_LEGACY] = legacy
    if added_later:
        extra["hash_unless_default"] = True  # the default it is compared with: `legacy` (pipeline/plan.py)
    return Field("auto", json_schema_extra=extra, **kw)


class Strict(BaseModel):
    """Every recipe model rejects unknown keys: a typo must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Resources(Strict):
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0, description="0 = CPU ranks on gloo")
    cpu_ranks: int = Field(1, ge=1, description="local ranks per node when gpus_per_node is 0")
    hostfile: str | None = Field(None, description="the nodes of a multi-node run: one `hostname slots=N` "
                                 "per line (DeepSpeed's format, for both launchers)")
    master_port: int | None = Field(None, ge=1024, le=65535, description="default: a free port")

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.cpu_ranks

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


Launcher = Literal["deepspeed", "torchrun", "local", "ray"]


class RaySettings(Strict):
    """Where and how a `launcher: ray` stage runs its ranks (pipeline/ray_launch.py, docs/ray.md)."""

    address: str = Field("auto", description="the Ray cluster: `auto` (the cluster this machine belongs "
                         "to, or $RAY_ADDRESS), `ray://host:10001` (Ray Client) or `host:6379` (the head's "
                         "GCS address)")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs each rank's worker reserves (beside its GPU)")
    placement_timeout_s: float = Field(300.0, gt=0, description="how long to wait for the cluster to have "
                                       "room for all of the stage's workers before failing")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:  # a mistyped address is named at its file:line, not at launch
        return check_address(v)


def launch_problem(resources: Resources, launcher: Launcher) -> str | None:
    """Why `resources` cannot be started by `launcher`, or None. Hostfile launchers need a
    hostfile to run on several nodes; Ray places the nodes itself and takes no hostfile."""
    if launcher == "ray":
        if resources.hostfile:
            return "launcher ray places the nodes itself: remove `hostfile` (it is for deepspeed / torchrun)"
        return None
    if resources.nodes > 1 and not resources.hostfile:
        return (f"nodes={resources.nodes} needs `hostfile` (one `hostname slots=N` line per node), "
                "or `launcher: ray` on a Ray cluster")
    return None


class RetryPolicy(Strict):
    """Prefect task retries of a stage (pipeline.flow); user errors are never retried."""

    retries: int | None = Field(None, ge=0, description="attempts after a failure that is not the user's "
                                "to fix (a crash, a store outage); unset: 1 for data stages, 0 for "
                                "distributed (training) stages")
    retry_delay_s: float = Field(10.0, ge=0, description="wait before each retry")


class StageConfig(Strict):
    """Base of every stage kind's config. Subclasses add `kind: Literal[...]`."""

    kind: str
    resources: Resources | None = Field(None, description="overrides defaults.resources")
    launcher: Launcher | None = Field(None, description="overrides defaults.launcher")
    ray: RaySettings | None = Field(None, description="overrides defaults.ray (launcher: ray)")
    retry: RetryPolicy | None = Field(None, description="overrides defaults.retry")
    log_every: int = cosmetic(1, ge=1, description="metrics logging interval (steps)")
    progress_deadline_min: float | None = cosmetic(
        None, gt=0, description="overrides defaults.progress_deadline_min: a job that prints no step, "
        "progress or heartbeat line for this long is stopped (its ranks' stacks dumped to its log)")
    eval_suite: EvalSuite | None = cosmetic(None, description="the evaluation suite this stage is "
                                            "judged on: the pipeline does not start the stage while "
                                            "its `data` overlaps the suite (stages/common/eval_suite_gate.py)")


ConfigT = TypeVar("ConfigT", bound=StageConfig)


def validation_problems(error: ValidationError, prefix: str = "") -> str:
    """`key.path: problem` per error of a pydantic validation, `; `-joined; never the values
    (a job file's values include credentials)."""
    problems = []
    for err in error.errors():
        key = ".".join(str(part) for part in (prefix, *err["loc"]) if part != "")
        problems.append(f"{key or '(top level)'}: {secrets.redact(err['msg'])}")
    return "; ".join(problems)


class StageJob(BaseModel):
    """What a stage's processes are given (serialised to job.json by the pipeline)."""

    recipe: str
    stage: str
    kind: str
    hash: str
    config: dict[str, Any]
    stage_url: str = Field(description="artifact directory of this stage in the store")
    storage_options: dict[str, Any] = {}
    upstream: dict[str, str] = Field({}, description="upstream stage name -> artifact URL")
    output_dir: str = Field(description="local dir; rank 0 writes the stage's outputs here")
    work_dir: str = Field(description="local scratch dir (downloads, local checkpoints)")
    tracking_uri: str | None = None
    run_id: str | None = None
    seed: int = 0
    store_timeout_s: float = Field(1800.0, gt=0, description="one store write (a file) that takes longer "
                                   "is abandoned and retried (storage.write_timeout_s)")
    store_attempts: int = Field(3, ge=1, description="tries of a store write (storage.write_attempts)")
    packages: dict[str, str] = Field({}, description=(
        "installed distributions the stage hash covers (StageKind.input_packages) -> the version "
        f"the hash was planned with ('{NOT_INSTALLED}' for one missing then); every rank checks its own "
        "before it starts (`check_packages`)"))

    # -- helpers for the stage's own process ------------------------------------
    @staticmethod
    def path_from_argv(argv: list[str] | None = None) -> Path:
        """The job file named by a job process's command line (`--job job.json`)."""
        parser = argparse.ArgumentParser()
        parser.add_argument("--job", required=True, help="path of the job.json")
        # deepspeed's launcher appends --local_rank=N; accept and ignore it
        parser.add_argument("--local_rank", type=int, default=None)
        args, _ = parser.parse_known_args(argv)
        return Path(args.job)

    @classmethod
    def read(cls, path: Path) -> "StageJob":
        """The job file at `path`, credentials put back from the environment. The pipeline
        wrote it; one that cannot be read or no longer parses (edited by hand) is a StageError
        naming the file and the key."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise StageError(f"job file {path}: cannot be read: {e.strerror or e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            where = f":{e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
            raise StageError(f"job file {path}{where}: not JSON: {getattr(e, 'msg', e)}") from None
        try:
            return cls.model_validate(secrets.resolve(data))  # credentials come from the environment
        except secrets.MissingSecret as e:
            raise StageError(str(e.args[0])) from None
        except ValidationError as e:
            raise StageError(f"job file {path}: {validation_problems(e)}") from None

    def check_packages(self) -> None:
        """A rank whose installed version of a hashed distribution (e.g. reasoning-gym) is not the
        planned one (upgraded since `plan`, installed since, or another node set up differently)
        would publish rows under a stage hash that does not describe them: a StageError naming the
        package, the planned version, this machine's and what to do."""
        if not self.packages:
            return
        import importlib.metadata as md  # only jobs that declare packages pay for it
        import socket

        for name, planned in sorted(self.packages.items()):
            try:
                here = md.version(name)
            except md.PackageNotFoundError:
                here = NOT_INSTALLED
            if here != planned:
                host = socket.gethostname()
                match = f"pip uninstall {name}" if planned == NOT_INSTALLED else f"pip install {name}=={planned}"
                raise StageError(
                    f"{name} differs from the plan: the stage hash was planned with {name} "
                    f"{planned}, but this machine ({host}, where this rank runs) has {name} {here}; its results "
                    f"would be published under a hash that does not describe them. Rerun `ring-pipeline plan`/"
                    f"`run` where the stage runs, so the stage hash covers the installed version (or `{match}` "
                    "on this machine to match the plan)")

    def typed_config(self, model: type[ConfigT], source: str | os.PathLike = "job.json") -> ConfigT:
        """`config` as the kind's config model: parsed once, at the job's entry (run_job),
        and handed to the kind's `main`. The pipeline validated it with the recipe; it is
        parsed again here because it crossed a process boundary as JSON, and a job file
        edited by hand gets a StageError naming `source` and the key."""
        try:
            return model.model_validate(self.config)
        except ValidationError as e:
            raise StageError(f"job file {source}: {validation_problems(e, 'config')}") from None

    def write(self, path: str | os.PathLike) -> str:
        """job.json, readable by its owner only, with every credential as a `${env:NAME}`
        reference (stages.common.secrets); returns its text (`secrets.job_env` of it is what the
        job's processes must be given)."""
        text = json.dumps(secrets.for_job(self.model_dump(mode="json")), indent=2)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)  # an existing file keeps its mode under O_CREAT
            f.write(text)
        return text

    @property
    def rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    def fetch(self, url: str) -> Path:
        """Local path of an input: an upstream artifact (or a file inside one), verified
        against its manifest's sha256, or an external fsspec URL / local path. A missing or
        corrupt input is the user's to fix: StageError."""
        try:
            return fetch_input(url, Path(self.work_dir) / "inputs", self.storage_options,
                               artifact_urls=list(self.upstream.values()))
        except ArtifactError as e:
            raise StageError(str(e)) from e
