"""The DAG of a recipe: order, per-stage content hash, what is done and what will run.

Stage hash = sha256(kind, the config keys that affect results, upstream stage hashes, the
content fingerprints of external inputs, the stage kind's declared `version`). Cosmetic keys
(log intervals, resources, launcher, retries) stay out, so moving a run to other hardware or changing
a log interval reuses artifacts. The kind's source code stays out too: a comment or a
refactor must not rerun days of training; a change that alters results bumps `version`
(the source digest is recorded in the manifest, and `plan` warns when it drifts).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable

from pydantic import BaseModel

from data_curation.urls import join
from pipeline.artifacts import ArtifactStore
from pipeline.fingerprints import BENCHMARK_INPUT, Fingerprint, benchmark_inputs, fingerprint_inputs, package_inputs
from pipeline.recipe import Recipe, iter_references, topological_order
from stages.common.contract import AUTO_LEGACY, Launcher, RaySettings, Resources, StageConfig
from stages.common.store_writes import WritePolicy
from stages.registry import STAGE_KINDS, StageKind

# StageConfig keys that never change results
_EXECUTION_KEYS = {"resources", "launcher", "ray", "retry"}


def result_config(model: BaseModel) -> Any:
    """The config as data, without cosmetic fields, nor `added_later` ones at their default
    (recursively); an `auto_setting` at `auto` as its old default (and, one that was `added_later`
    before it became `auto`, left out at `auto` and at its old default)."""
    out: dict[str, Any] = {}
    for name, field in type(model).model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("cosmetic") or (isinstance(model, StageConfig) and name in _EXECUTION_KEYS):
            continue
        value = getattr(model, name)
        if AUTO_LEGACY in extra and value == "auto":
            value = extra[AUTO_LEGACY]  # hashed as before `auto` existed (contract.auto_setting)
        if extra.get("hash_unless_default") and value == extra.get(AUTO_LEGACY, field.default):
            continue  # the hash of a config written before the field existed is unchanged
        out[name] = _result_value(value)
    return out


def _result_value(v: Any) -> Any:
    if isinstance(v, BaseModel):
        return result_config(v)
    if isinstance(v, dict):
        return {k: _result_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_result_value(x) for x in v]
    return v


def input_fingerprints(kind: StageKind, config: StageConfig, storage_options: dict[str, Any],
                       hash_max_bytes: int, tolerate_errors: bool = False) -> dict[str, Fingerprint]:
    """The config's external inputs, and the installed libraries the kind says its results
    depend on (`StageKind.input_packages`)."""
    inputs = fingerprint_inputs(result_config(config), storage_options, hash_max_bytes, tolerate_errors)
    inputs.update(benchmark_inputs(config, storage_options, hash_max_bytes))
    if kind.input_packages is not None:
        inputs.update(package_inputs(kind.input_packages(config)))
    return inputs


def hash_payload(kind: StageKind, config: StageConfig, upstream: dict[str, str],
                 inputs: dict[str, Fingerprint]) -> dict[str, Any]:
    """Everything the stage hash covers (also recorded in the manifest, so `plan` can say
    what changed since an earlier artifact of the stage)."""
    return {
        "kind": kind.name,
        "version": kind.version,
        "config": result_config(config),
        "upstream": dict(sorted(upstream.items())),
        "inputs": {k: fp.digest for k, fp in sorted(inputs.items())},
    }


def stage_hash(kind: StageKind, config: StageConfig, upstream: dict[str, str],
               inputs: dict[str, Fingerprint]) -> str:
    blob = json.dumps(hash_payload(kind, config, upstream, inputs), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def resolve_references(value: Any, urls: dict[str, str]) -> Any:
    """Replace `${stages.X.output}[/sub]` with the artifact URL of X (+ /sub)."""
    if isinstance(value, dict):
        return {k: resolve_references(v, urls) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_references(v, urls) for v in value]
    if isinstance(value, str) and "${stages." in value:
        (_, _, target, sub), = list(iter_references(value))
        return join(urls[target], sub) if sub else urls[target]
    return value


@dataclass
class PlannedStage:
    """One stage as planned (`plan_stage`): its hash, artifact URL and what it needs."""

    recipe: str
    name: str
    kind: StageKind
    config: StageConfig
    deps: list[str]
    hash: str
    url: str
    resources: Resources
    launcher: Launcher
    seed: int
    inputs: dict[str, Fingerprint]
    upstream: dict[str, str]  # dep name -> its hash
    upstream_urls: dict[str, str]  # dep name -> its artifact URL
    progress_deadline_s: float | None = None  # pipeline.launch stops a job silent for longer
    ray: RaySettings | None = None  # the cluster of a `launcher: ray` stage
    done: bool = False

    @property
    def short_hash(self) -> str:
        return self.hash[:12]

    def resolved_config(self) -> dict[str, Any]:
        """The config as data, `${stages.X.output}` references replaced by artifact URLs."""
        return resolve_references(self.config.model_dump(mode="json"), self.upstream_urls)

    @property
    def hashed(self) -> dict[str, Any]:
        return hash_payload(self.kind, self.config, self.upstream, self.inputs)


@dataclass
class Plan:
    recipe: Recipe
    store: ArtifactStore
    stages: list[PlannedStage]

    def __getitem__(self, name: str) -> PlannedStage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def downstream(self, names: Iterable[str]) -> set[str]:
        """The given stages and everything that depends on them."""
        out = set(names)
        for s in self.stages:  # topological order: one pass suffices
            if any(d in out for d in s.deps):
                out.add(s.name)
        return out

    def select(self, only: list[str] = (), from_: str | None = None,
               force: list[str] = ()) -> tuple[list[str], set[str]]:
        """(stages to consider, stages to rerun even if published).

        --only X: just X (its inputs must be published already).
        --from X: X and everything downstream of it, rerun.
        --force X: rerun X (and, since their inputs change, what depends on it).
        """
        for n in [*only, *force, *([from_] if from_ else [])]:
            if n not in self.names:
                raise KeyError(f"no stage named {n!r} in recipe {self.recipe.name!r} "
                               f"(stages: {', '.join(self.names)})")
        forced: set[str] = set()
        if from_:
            forced |= self.downstream([from_])
        forced |= self.downstream(force) if force else set()
        selected = [n for n in self.names if (not only or n in only)]
        if from_:
            selected = [n for n in selected if n in self.downstream([from_])]
        return selected, forced

    def unavailable_benchmarks(self, names: Iterable[str], forced: Iterable[str] = ()) -> list[str]:
        """Per hub-named benchmark set that a stage of `names` still to run cannot read here
        (neither in the hub cache nor under RING_BENCHMARKS_DIR): the stage and what to do.
        A run checks this before any stage starts."""
        wanted, rerun = set(names), set(forced)
        return [f"stage {s.name}: {fp.summary}" for s in self.stages
                if s.name in wanted and (not s.done or s.name in rerun)
                for key, fp in s.inputs.items() if key.startswith(BENCHMARK_INPUT) and fp.kind == "missing"]


def plan_stage(recipe: str, name: str, cfg: StageConfig, upstream: dict[str, tuple[str, str]],
               store: ArtifactStore, resources: Resources, launcher: Launcher, seed: int,
               hash_max_bytes: int, tolerate_errors: bool = False,
               progress_deadline_s: float | None = None, ray: RaySettings | None = None) -> PlannedStage:
    """One stage's hash and artifact URL from its config and its upstream stages (name ->
    (artifact URL, hash)): how a recipe's stages (`make_plan`) and a stage without a recipe
    (`pipeline.execute.adhoc_target`) are planned."""
    kind = STAGE_KINDS[cfg.kind]
    hashes = {d: h for d, (_, h) in upstream.items()}
    inputs = input_fingerprints(kind, cfg, store.storage_options, hash_max_bytes, tolerate_errors)
    h = stage_hash(kind, cfg, hashes, inputs)
    return PlannedStage(recipe=recipe, name=name, kind=kind, config=cfg, deps=list(upstream), hash=h,
                        url=store.stage_url(name, h), resources=resources, launcher=launcher, seed=seed,
                        inputs=inputs, upstream=hashes, upstream_urls={d: u for d, (u, _) in upstream.items()},
                        progress_deadline_s=progress_deadline_s, ray=ray)


def make_plan(recipe: Recipe, check_store: bool = True) -> Plan:
    """The ordered stages with hashes; `check_store` asks the store which are published."""
    store = ArtifactStore(join(recipe.storage.url, recipe.name), recipe.storage.options,
                          WritePolicy(recipe.storage.write_timeout_s, recipe.storage.write_attempts))
    deps = recipe.dependencies()
    planned: dict[str, PlannedStage] = {}
    for name in topological_order(deps):
        planned[name] = plan_stage(
            recipe.name, name, recipe.stages[name], {d: (planned[d].url, planned[d].hash) for d in deps[name]},
            store, recipe.stage_resources(name), recipe.stage_launcher(name), recipe.defaults.seed,
            recipe.defaults.input_hash_max_bytes, tolerate_errors=not check_store,
            progress_deadline_s=recipe.stage_progress_deadline_s(name), ray=recipe.stage_ray(name))
    plan = Plan(recipe, store, list(planned.values()))
    if check_store:
        for s in plan.stages:
            s.done = store.is_done(s.url)
    return plan
