"""The Prefect flow built from a plan: one task per stage, edges from references.

A task skips a stage whose artifact is published (`_SUCCESS` at its hash), so a retried
flow run (Prefect UI "Retry", `prefect flow-run retry`) reruns only what did not
finish. Task results are small `StageRun` dicts (URLs and hashes), persisted by Prefect.
A stopped run (pipeline.interrupt) starts no further stage.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.futures import wait

from pipeline import interrupt
from pipeline.execute import ExecutionPolicy, StageTarget, execute
from pipeline.loader import load_recipe
from pipeline.plan import Plan, make_plan
from pipeline.tracking import PipelineTracker


@task(persist_result=True)
def run_stage_task(target: dict[str, Any], recipe_path: str, overrides: list[str], force: bool,
                   tracking: dict[str, Any] | None, wait_if_running: bool = True) -> dict[str, Any]:
    """Re-plan from the recipe (cheap, and keeps task parameters small) and execute one stage."""
    from prefect.runtime import flow_run

    interrupt.raise_if_stopping(f"stage {target['stage']!r}")
    plan = make_plan(load_recipe(recipe_path, overrides))
    stage = plan[target["stage"]]
    tracker = PipelineTracker.attach(**tracking) if tracking else None
    policy = ExecutionPolicy.of(plan.recipe.storage, wait_if_running=wait_if_running,
                                flow_run_id=flow_run.id)
    result = execute(StageTarget.from_plan(plan, stage), plan.store,
                     Path(plan.recipe.defaults.work_dir), policy, tracker, force=force)
    get_run_logger().info("stage %s %s: %s", stage.name, result.status, result.url)
    return result.as_dict()


def _target_param(plan: Plan, name: str) -> dict[str, Any]:
    s = plan[name]  # shown in the Prefect UI; the task re-plans from the recipe itself
    return {"stage": name, "kind": s.kind.name, "hash": s.hash, "url": s.url}


@flow(name="ring-pipeline", log_prints=True, validate_parameters=True)
def pipeline_flow(recipe_path: str, overrides: list[str] | None = None, only: list[str] | None = None,
                  from_stage: str | None = None, force: list[str] | None = None,
                  wait_if_running: bool = True) -> dict[str, Any]:
    """Run a recipe: every selected stage as a Prefect task, in dependency order."""
    overrides = list(overrides or [])
    recipe = load_recipe(recipe_path, overrides)
    plan = make_plan(recipe)
    selected, forced = plan.select(only or [], from_stage, force or [])
    tracker = PipelineTracker(recipe.tracking.uri, recipe.tracking.experiment or recipe.name,
                              recipe.name, {"recipe": str(recipe_path), "overrides": overrides,
                                            "stages": selected})
    futures: dict[str, Any] = {}
    results: dict[str, Any] = {}
    try:
        for stage in plan.stages:
            if stage.name not in selected:
                continue
            waits = [futures[d] for d in stage.deps if d in futures]
            futures[stage.name] = run_stage_task.with_options(
                name=f"stage:{stage.name}", task_run_name=f"{stage.name}-{stage.short_hash}",
                refresh_cache=stage.name in forced,
            ).submit(_target_param(plan, stage.name), str(Path(recipe_path).resolve()), overrides,
                     stage.name in forced, tracker.handle(), wait_if_running, wait_for=waits)
        wait(list(futures.values()))  # let independent branches finish before reporting
        for name, fut in futures.items():
            results[name] = fut.result()
    except BaseException:
        tracker.end("KILLED" if interrupt.stop_requested() else "FAILED")
        raise
    for name, r in results.items():
        if r["status"] == "skipped":
            tracker.tag_stage_skipped(name, r["hash"], r["url"])
    tracker.end("FINISHED")
    return results
