"""The Prefect flow built from a plan: one task per stage, edges from references.

A task skips a stage whose artifact is published (`_SUCCESS` at its hash), so a retried
flow run (Prefect UI "Retry", `prefect flow-run retry`) reruns only what did not
finish. Task results are small `StageRun` dicts (URLs and hashes), persisted by Prefect.
A stopped run (pipeline.interrupt) starts no further stage.

What the Prefect UI shows: flow runs named `{recipe} {time}` like their MLflow parent run
(each tagged with the other's id); per stage a markdown artifact (headline numbers, artifact
URL, MLflow run; or what failed) and readable log lines; per flow run the plan table. A
stage retries (`retry` in the recipe) a failure that is not the user's to fix. Every stage
runs to its end before the flow reports: a flow run with failed stages fails once, naming
all of them (`PipelineFailed`).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.futures import wait

from data_curation.urls import join
from pipeline import console, interrupt
from pipeline.artifacts import ArtifactStore
from pipeline.execute import ExecutionPolicy, StageRun, StageTarget, execute
from pipeline.failures import StageFailure
from pipeline.loader import load_recipe
from pipeline.plan import Plan, make_plan
from pipeline.recipe import StorageConfig
from pipeline.stage_metrics import describe
from pipeline.tracking import PipelineTracker, timestamped
from stages.common import secrets


class PipelineFailed(RuntimeError):
    """Stages of the run failed; `failures` says what happened to each (pipeline.failures),
    `not_started` lists the stages that waited for them."""

    def __init__(self, message: str, failures: dict[str, StageFailure] | None = None,
                 not_started: list[str] | None = None, results: dict[str, Any] | None = None):
        super().__init__(message)
        self.failures, self.not_started, self.results = failures or {}, not_started or [], results or {}


def _artifact_key(*parts: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")


def _failure_of(stage: str, error: BaseException) -> StageFailure:
    failure = getattr(error, "failure", None)
    return failure if isinstance(failure, StageFailure) else StageFailure.of(stage, error)


def _retryable(task, task_run, state) -> bool:
    """Prefect's retry condition: a crash or a store outage, never a user error or a stop."""
    if interrupt.stop_requested():
        return False
    return _failure_of("", state.data).retryable if isinstance(state.data, BaseException) else True


def _stage_markdown(name: str, kind: str, result: StageRun | None, failure: StageFailure | None) -> str:
    if failure is not None:
        lines = [f"## {name} ({kind}): failed", "", f"**{failure.category}**", "", "```text", failure.reason]
        lines += [f"  | {ln}" for ln in failure.excerpt]
        lines += ["```", "", f"- stage log: `{failure.log or '-'}`",
                  f"- MLflow run: {_md_link(failure.run_link or failure.run_id)}"]
        return "\n".join(lines)
    assert result is not None
    lines = [f"## {name} ({kind}): {'done in %.1f s' % result.seconds if result.status == 'ran' else 'cached'}", ""]
    if result.headline:
        lines += ["| metric | first | last |", "|---|---|---|"]
        lines += [f"| {k} | {v[0]:.4g} | {v[-1]:.4g} |" for k, v in result.headline.items()]
        lines.append("")
    lines += [f"- artifact: `{result.url}`", f"- hash: `{result.hash[:12]}`"]
    if result.run_id:
        lines.append(f"- MLflow run: {_md_link(result.run_link or result.run_id)}")
    return "\n".join(lines)


def _md_link(link: str | None) -> str:
    if not link:
        return "-"
    return f"[{link}]({link})" if link.startswith(("http://", "https://")) else f"`{link}`"


@task(persist_result=True)
def run_stage_task(target: StageTarget, storage: StorageConfig, work_dir: str, retry: tuple[int, float],
                   force: bool, tracking: dict[str, Any] | None, wait_if_running: bool = True) -> dict[str, Any]:
    """Execute one stage of the run's plan (planned once, by the flow)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.runtime import flow_run, task_run

    name, kind, logger = target.name, target.kind.name, get_run_logger()
    try:
        interrupt.raise_if_stopping(f"stage {name!r}")
        # the handle holds the tracking URI as its ${env:} reference (a task parameter): resolved here
        tracker = PipelineTracker.attach(**secrets.resolve(tracking, secrets.job_env(json.dumps(tracking)))) \
            if tracking else None
        policy = ExecutionPolicy.of(storage, wait_if_running=wait_if_running, flow_run_id=flow_run.id)
        result = execute(target, ArtifactStore(join(storage.url, target.recipe), storage.options), Path(work_dir),
                         policy, tracker, force=force)
    except BaseException as e:
        secrets.scrub_exception(e)  # Prefect stores its message and traceback
        if not isinstance(getattr(e, "failure", None), StageFailure):  # failed before its job: not reported yet
            e.failure = StageFailure.of(name, e)  # type: ignore[attr-defined]
            console.current().stage_failed(name, e.failure.report(), e.failure.verdict)
        failure = e.failure
        logger.error("%s failed: %s", name, secrets.redact(failure.report()))
        create_markdown_artifact(secrets.redact(_stage_markdown(name, kind, None, failure)),
                                 key=_artifact_key(target.recipe, name), description=f"{name}: failed")
        retries, delay = retry
        if failure.retryable and task_run.run_count <= retries and not interrupt.stop_requested():
            console.current().stage_note(name, f"retrying in {delay:.0f}s (attempt {task_run.run_count + 1} "
                                               f"of {retries + 1})")
        raise
    what = "cached" if result.status == "skipped" else f"done in {result.seconds:.1f}s"
    logger.info("%s %s", name, secrets.redact("  ".join(p for p in (what, describe(result.headline), f"-> {result.url}",
                                                     f"MLflow run: {result.run_link}" if result.run_link else "")
                                          if p)))
    create_markdown_artifact(secrets.redact(_stage_markdown(name, kind, result, None)),
                             key=_artifact_key(target.recipe, name), description=f"{name}: {what}")
    return secrets.public(result.as_dict())  # persisted by Prefect


def _flow_run_name() -> str:
    """`{recipe} {time}`, the name its MLflow parent run gets too."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    try:
        name = load_recipe(params["recipe_path"], list(params.get("overrides") or [])).name
    except Exception:  # noqa: BLE001 - the flow itself reports a broken recipe
        name = Path(params["recipe_path"]).stem
    return timestamped(name)


def _open_tracker(recipe, recipe_path: str, overrides: list[str], selected: list[str], run_name: str,
                  prefect_ui: str | None) -> PipelineTracker:
    from prefect.runtime import flow_run

    description = "\n\n".join(p for p in (recipe.description, f"`ring-pipeline run {recipe_path}"
                                          + "".join(f" --set {o}" for o in overrides) + "`") if p)
    tags = {"ring.recipe": recipe.name, "prefect.flow_run_id": str(flow_run.id),
            "prefect.flow_run_name": run_name, "mlflow.source.name": str(recipe_path)}
    if prefect_ui:
        tags["prefect.flow_run_url"] = prefect_ui
    tracker = PipelineTracker(recipe.tracking.uri, recipe.tracking.experiment or recipe.name, run_name,
                              {"recipe": str(recipe_path), "overrides": overrides, "stages": selected},
                              description=description, tags=tags,
                              artifact_location=recipe.tracking.artifact_location, ui_url=recipe.tracking.ui_url)
    tracker.attach_text(Path(recipe_path).read_text(), f"recipe/{Path(recipe_path).name}")
    # credentials as their `${env:NAME}` references, or masked (stages.common.secrets)
    tracker.attach_text(yaml.safe_dump(secrets.public(recipe.model_dump(mode="json", exclude_defaults=False)),
                                       sort_keys=False), "recipe/resolved.yaml")
    return tracker


def _link_flow_run_to(tracker: PipelineTracker) -> None:
    """Tag the flow run with its MLflow parent run, so either leads to the other."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        tags = list(flow_run.tags or [])
        client.update_flow_run(flow_run.id, tags=[*tags, f"mlflow-run:{tracker.parent_id}"])


def _plan_markdown(plan: Plan, selected: list[str], outcome: dict[str, str], times: dict[str, float],
                   tracker: PipelineTracker | None, nothing_ran: bool) -> str:
    lines = [f"# {plan.recipe.name}", ""]
    if plan.recipe.description:
        lines += [plan.recipe.description, ""]
    if nothing_ran:
        lines += ["Every selected stage was published already: nothing ran (no MLflow run).", ""]
    elif tracker is not None:
        lines += [f"MLflow parent run: {_md_link(tracker.run_link(tracker.parent_id))}", ""]
    lines += ["| stage | kind | status | hash | time |", "|---|---|---|---|---|"]
    for s in plan.stages:
        if s.name in selected:
            t = f"{times[s.name]:.1f} s" if s.name in times else "-"
            lines.append(f"| {s.name} | {s.kind.name} | {outcome.get(s.name, '?')} | `{s.short_hash}` | {t} |")
    return "\n".join(lines)


@flow(name="ring-pipeline", flow_run_name=_flow_run_name, validate_parameters=True)
def pipeline_flow(recipe_path: str, overrides: list[str] | None = None, only: list[str] | None = None,
                  from_stage: str | None = None, force: list[str] | None = None,
                  wait_if_running: bool = True) -> dict[str, Any]:
    """Run a recipe: every selected stage as a Prefect task, in dependency order."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.runtime import flow_run

    overrides = list(overrides or [])
    recipe = load_recipe(recipe_path, overrides)
    plan = make_plan(recipe)
    selected, forced = plan.select(only or [], from_stage, force or [])
    run_name = flow_run.name or timestamped(recipe.name)
    prefect_ui = flow_run.ui_url if os.environ.get("PREFECT_API_URL") else None  # the embedded server has no UI
    tracker = _open_tracker(recipe, recipe_path, overrides, selected, run_name, prefect_ui)
    _link_flow_run_to(tracker)
    to_run = [n for n in selected if n in forced or not plan[n].done]
    console.current().say(f"{run_name}: {len(to_run)} of {len(selected)} stages to run"
                          + (f"\n  Prefect flow run: {prefect_ui}" if prefect_ui else "")
                          + f"\n  MLflow run: {tracker.run_link(tracker.parent_id)}")
    futures: dict[str, Any] = {}
    started = time.time()
    try:
        for stage in plan.stages:
            if stage.name not in selected:
                continue
            retries, delay = recipe.stage_retry(stage.name)
            waits = [futures[d] for d in stage.deps if d in futures]
            futures[stage.name] = run_stage_task.with_options(
                name=f"stage:{stage.name}", task_run_name=f"{stage.name}-{stage.short_hash}",
                refresh_cache=stage.name in forced, retries=retries, retry_delay_seconds=delay,
                retry_condition_fn=_retryable,
            ).submit(StageTarget.of(stage), recipe.storage, recipe.defaults.work_dir, (retries, delay),
                     stage.name in forced, tracker.handle(), wait_if_running, wait_for=waits)
        wait(list(futures.values()))  # every branch runs to its end before the run reports
    except BaseException:
        tracker.end("KILLED" if interrupt.stop_requested() else "FAILED")
        raise
    results: dict[str, Any] = {}
    failures: dict[str, StageFailure] = {}
    not_started: list[str] = []
    for name, fut in futures.items():
        state = fut.state
        if state.is_completed():
            results[name] = fut.result()
        elif state.is_failed() or state.is_crashed():
            failures[name] = _failure_of(name, fut.result(raise_on_failure=False))
        else:  # NotReady: an upstream failed
            not_started.append(name)
    outcome = {**{n: r["status"] for n, r in results.items()}, **{n: f"failed ({f.category})" for n, f in
                                                                   failures.items()},
               **{n: "not started" for n in not_started}}
    times = {n: r["seconds"] for n, r in results.items() if r["status"] == "ran"}
    nothing_ran = not times and not failures and not not_started
    create_markdown_artifact(secrets.redact(_plan_markdown(plan, selected, outcome, times, tracker, nothing_ran)),
                             key=_artifact_key(recipe.name, "pipeline"),
                             description=f"{run_name}: {len(times)} ran, {len(failures)} failed, "
                                         f"{len(results) - len(times)} cached, {time.time() - started:.0f} s")
    for name, r in results.items():
        if r["status"] == "skipped":
            tracker.tag_stage_skipped(name, r["hash"], r["url"])
    if failures or not_started:
        tracker.end("KILLED" if interrupt.stop_requested() else "FAILED")
        listed = ", ".join(f"{n} ({f.category})" for n, f in failures.items())
        waiting = f"; not started: {', '.join(not_started)}" if not_started else ""
        raise PipelineFailed(f"{len(failures)} of {len(selected)} stages failed: {listed}{waiting}",
                             failures, not_started, results)
    if nothing_ran:
        tracker.discard()
    else:
        tracker.end("FINISHED")
    return results
