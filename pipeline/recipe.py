"""Pydantic models of a recipe: one discriminated union over the registered stage kinds."""
from __future__ import annotations

from typing import Annotated, Any, Iterator, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from pipeline.endpoints import form_problem, tracking_form_problem
from stages.common.contract import (
    REFERENCE_RE,
    Launcher,
    RaySettings,
    Resources,
    RetryPolicy,
    StageConfig,
    Strict,
    launch_problem,
)
from stages.registry import STAGE_KINDS


def _refused(problem: str | None, value: str) -> str:
    """`value`, or the ValueError pydantic reports with the key's `file:line` (pipeline.loader)."""
    if problem:
        raise ValueError(problem)
    return value


class StorageConfig(Strict):
    url: str = Field("file://./.ring/artifacts", description="fsspec URL of the artifact store")
    options: dict[str, Any] = Field({}, description="fsspec storage options (s3: endpoint_url, key, ...)")
    keep_checkpoints: int = Field(2, ge=0, description="mid-stage checkpoints a published artifact "
                                  "keeps (newest first; 0 = the final model only)")
    lease_timeout_s: float = Field(60.0, gt=0, description="a running stage's `_RUNNING` lease whose "
                                   "heartbeat is older than this was left by a dead run and is taken over")
    write_timeout_s: float = Field(1800.0, gt=0, description="a store write (one file of an artifact or "
                                   "checkpoint) that takes longer is abandoned and retried")
    write_attempts: int = Field(3, ge=1, description="tries of a store write, with backoff between them")

    @field_validator("url")
    @classmethod
    def _known_protocol(cls, v: str) -> str:
        return _refused(form_problem(v), v)


class TrackingConfig(Strict):
    uri: str = Field("sqlite:///.ring/mlflow.db", description="MLflow tracking URI")
    experiment: str | None = Field(None, description="MLflow experiment (default: the recipe name)")
    artifact_location: str | None = Field(
        None, description="where a new experiment keeps its artifacts (default: `mlartifacts` beside a "
        "SQLite tracking DB; the tracking server's choice otherwise)")
    ui_url: str | None = Field(None, description="the MLflow UI's address, for links to runs (default: the "
                               "tracking URI when it is a server; e.g. http://127.0.0.1:5000 for `mlflow ui`)")

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        return _refused(tracking_form_problem(v), v)


class Defaults(Strict):
    resources: Resources = Resources()
    launcher: Launcher = "deepspeed"
    ray: RaySettings = Field(RaySettings(), description="the Ray cluster of `launcher: ray` stages")
    retry: RetryPolicy = RetryPolicy()
    seed: int = 0
    progress_deadline_min: float = Field(
        30.0, gt=0, description="a distributed stage's job that prints no step, progress or heartbeat line "
        "for this long is hung: its ranks' stacks are dumped to its log, the ranks stopped, the stage failed "
        "(a retry resumes from its last checkpoint); a stage's own `progress_deadline_min` overrides it")
    work_dir: str = Field(".ring/work", description="local scratch for stage jobs")
    input_hash_max_bytes: int = Field(
        64 << 20, ge=0, description="local inputs (file, directory, glob) up to this total size are "
        "fingerprinted by content (sha256), larger ones by size + mtime")


def _stage_union() -> Any:
    configs = tuple(k.config for k in STAGE_KINDS.values())
    return Annotated[Union[configs], Field(discriminator="kind")]  # type: ignore[valid-type]


StageSpec = _stage_union()


def iter_references(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, str, str, str]]:
    """(key path, raw string, referenced stage, sub-path) for every `${stages.X.output}`."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from iter_references(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from iter_references(v, (*path, i))
    elif isinstance(value, str) and "${stages." in value:
        m = REFERENCE_RE.match(value)
        if not m:
            raise ReferenceSyntaxError(path, value)
        yield path, value, m.group(1), (m.group(2) or "").lstrip("/")


class ReferenceSyntaxError(ValueError):
    def __init__(self, path: tuple, value: str):
        self.path = path
        super().__init__(f"bad reference {value!r}: a reference is a whole value of the form "
                         "${stages.NAME.output} or ${stages.NAME.output}/sub/path")


class RecipeGraphError(ValueError):
    """A reference to a missing stage, a cycle, or settings that contradict each other across
    sections (a stage's launcher and its resources); `path` locates it in the recipe."""

    def __init__(self, path: tuple, message: str):
        self.path = path
        super().__init__(message)


class Recipe(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="names the store prefix")
    description: str = ""
    storage: StorageConfig = StorageConfig()
    tracking: TrackingConfig = TrackingConfig()
    defaults: Defaults = Defaults()
    stages: dict[str, StageSpec] = Field(min_length=1)  # type: ignore[valid-type]
    # where each key path was written (pipeline.loader: `file:line`), for errors found later
    _origins: dict = PrivateAttr(default_factory=dict)

    @field_validator("stages")
    @classmethod
    def _stage_names(cls, v: dict[str, StageConfig]) -> dict[str, StageConfig]:
        for name in v:
            if not REFERENCE_RE.match(f"${{stages.{name}.output}}"):
                raise ValueError(f"stage name {name!r}: use letters, digits, _ and -")
        return v

    @model_validator(mode="after")
    def _graph(self) -> "Recipe":
        self.dependencies()  # raises RecipeGraphError on a missing stage or a cycle
        self._check_launches()
        return self

    def _check_launches(self) -> None:
        """Each distributed stage's resources can be started by its launcher (both may come
        from `defaults`: the error names the section the resources came from)."""
        for name, spec in self.stages.items():
            if not STAGE_KINDS[spec.kind].distributed:
                continue
            problem = launch_problem(self.stage_resources(name), self.stage_launcher(name))
            if problem:
                where = ("stages", name, "resources") if spec.resources else ("defaults", "resources")
                raise RecipeGraphError(where, f"stage {name!r}: {problem}")

    def dependencies(self) -> dict[str, list[str]]:
        """stage -> the stages it reads, in recipe order; checks references and cycles."""
        deps: dict[str, list[str]] = {}
        for name, spec in self.stages.items():
            found: list[str] = []
            try:
                refs = list(iter_references(spec.model_dump(mode="json")))
            except ReferenceSyntaxError as e:
                raise RecipeGraphError(("stages", name, *e.path), str(e)) from None
            for path, raw, target, _ in refs:
                if target not in self.stages:
                    raise RecipeGraphError(("stages", name, *path),
                                           f"{raw} refers to stage {target!r}, which is not in the recipe "
                                           f"(stages: {', '.join(self.stages)})")
                if target == name:
                    raise RecipeGraphError(("stages", name, *path), f"stage {name!r} refers to its own output")
                if target not in found:
                    found.append(target)
            deps[name] = found
        _check_acyclic(deps)
        return deps

    def stage_resources(self, name: str) -> Resources:
        return self.stages[name].resources or self.defaults.resources

    def stage_launcher(self, name: str) -> Launcher:
        return self.stages[name].launcher or self.defaults.launcher

    def stage_progress_deadline_s(self, name: str) -> float | None:
        """Seconds a stage's job may go without progress: its own setting, else (distributed
        stages only) `defaults.progress_deadline_min`; None: no deadline."""
        own = self.stages[name].progress_deadline_min
        if own is not None:
            return own * 60
        return self.defaults.progress_deadline_min * 60 if STAGE_KINDS[self.stages[name].kind].distributed else None

    def stage_ray(self, name: str) -> RaySettings:
        return self.stages[name].ray or self.defaults.ray

    def stage_retry(self, name: str) -> tuple[int, float]:
        """(retries, delay in seconds) of a stage: its own `retry`, else `defaults.retry`;
        retries unset anywhere: 1 for a data stage, 0 for a training (distributed) one."""
        own, default = self.stages[name].retry, self.defaults.retry
        retries = next((p.retries for p in (own, default) if p is not None and p.retries is not None), None)
        if retries is None:
            retries = 0 if STAGE_KINDS[self.stages[name].kind].distributed else 1
        delay = own.retry_delay_s if own is not None and "retry_delay_s" in own.model_fields_set \
            else default.retry_delay_s
        return retries, delay


def _check_acyclic(deps: dict[str, list[str]]) -> None:
    state: dict[str, int] = {}

    def visit(n: str, trail: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            cycle = trail[trail.index(n):] + [n]
            raise RecipeGraphError(("stages", n), "stages form a cycle: " + " -> ".join(cycle))
        state[n] = 1
        for d in deps[n]:
            visit(d, [*trail, n])
        state[n] = 2

    for n in deps:
        visit(n, [])


def topological_order(deps: dict[str, list[str]]) -> list[str]:
    """Dependencies first; otherwise the recipe's own order."""
    out: list[str] = []

    def visit(n: str) -> None:
        if n in out:
            return
        for d in deps[n]:
            visit(d)
        out.append(n)

    for n in deps:
        visit(n)
    return out
