"""`ring-pipeline ...`: the user's entry point. Nothing imports this module."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from pipeline.loader import RecipeError, load_recipe

# Prefect's ephemeral server reports telemetry into its SQLite DB, racing the flow's own writes.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Run the Ring-1T training recipe as one declarative pipeline.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"ring-pipeline {version('ring-pipeline')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("ring-pipeline (not installed: run `pip install -e .`)")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_version,
                                       help="print the version and exit")) -> None:
    """Run the Ring-1T training recipe as one declarative pipeline."""

RecipeArg = typer.Argument(..., help="recipe YAML file")
SetOpt = typer.Option([], "--set", help="override a recipe value: KEY.PATH=VALUE (repeatable)")


def _fail(message: str, code: int) -> None:
    typer.secho(message, err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def _load(recipe: Path, overrides: list[str]):
    try:
        return load_recipe(recipe, overrides)
    except RecipeError as e:
        _fail("recipe error:\n" + "\n".join(f"  {p}" for p in e.problems), 2)


def _plan(recipe):
    from pipeline.plan import make_plan

    try:
        return make_plan(recipe)
    except Exception as e:  # store unreachable, bad credentials, ...
        _fail(f"cannot reach the artifact store {recipe.storage.url}: {type(e).__name__}: {e}", 1)


@app.command()
def validate(recipe: Path = RecipeArg, set_: list[str] = SetOpt) -> None:
    """Check a recipe (schema, values, references, cycles) without running anything."""
    r = _load(recipe, set_)
    typer.echo(f"{recipe}: ok ({len(r.stages)} stages: {', '.join(r.stages)})")


@app.command()
def plan(recipe: Path = RecipeArg, set_: list[str] = SetOpt) -> None:
    """Stages in order with their hashes, what is done / to run, and each launch command."""
    from pipeline.launch import build_command

    from pipeline.plan import make_plan

    r = _load(recipe, set_)
    try:
        p, unknown = make_plan(r), None
    except Exception as e:  # planning must work where the store is out of reach
        p, unknown = make_plan(r, check_store=False), f"{type(e).__name__}: {e}"
    typer.echo(f"recipe {p.recipe.name}  store {p.store.root}")
    if unknown:
        typer.secho(f"store not reachable ({unknown}): done / to run unknown", fg=typer.colors.YELLOW)
    for i, s in enumerate(p.stages, 1):
        status = "?" if unknown else "done" if s.done else "to run"
        typer.echo(f"{i:>2}. {s.name:<16} {s.kind.name:<14} {s.short_hash}  {status:<7} "
                   f"needs: {', '.join(s.deps) or '-'}")
        typer.echo(f"    artifact: {s.url}")
        cmd = build_command(s.kind.entry, Path("<job.json>"), s.resources, s.launcher, s.kind.distributed)
        typer.echo(f"    launch:   {' '.join(cmd)}  (world size {s.resources.world_size if s.kind.distributed else 1})")


@app.command()
def run(recipe: Path = RecipeArg, set_: list[str] = SetOpt,
        only: list[str] = typer.Option([], "--only", help="run just this stage (repeatable)"),
        from_: Optional[str] = typer.Option(None, "--from", help="rerun this stage and everything after it"),
        force: list[str] = typer.Option([], "--force", help="rerun this stage (and its dependents)")) -> None:
    """Run the recipe as a Prefect flow; published stages are skipped."""
    r = _load(recipe, set_)
    p = _plan(r)
    try:
        p.select(only, from_, force)
    except KeyError as e:
        _fail(str(e.args[0]), 2)
    from pipeline.artifacts import ArtifactError
    from pipeline.flow import pipeline_flow
    from pipeline.launch import StageFailed

    try:
        results = pipeline_flow(str(recipe), set_, only or None, from_, force or None)
    except (StageFailed, ArtifactError) as e:
        _fail(str(e), 1)
    except KeyboardInterrupt:
        _fail("interrupted: stage jobs were stopped; rerun to resume from the last checkpoints", 130)
    for name, res in results.items():
        extra = f" in {res['seconds']:.1f}s" if res["status"] == "ran" else ""
        typer.echo(f"{name}: {res['status']}{extra} -> {res['url']}")


@app.command()
def status(recipe: Path = RecipeArg, set_: list[str] = SetOpt) -> None:
    """Per stage: done / failed / pending, its artifact URI and MLflow run."""
    from pipeline.execute import read_failure

    p = _plan(_load(recipe, set_))
    for s in p.stages:
        if s.done:
            m = p.store.read_manifest(s.url)
            state, run_id = "done", m.get("mlflow_run_id")
        else:
            failure = read_failure(p.store, s.url)
            state = "failed" if failure else "pending"
            run_id = failure.get("run_id") if failure else None
        typer.echo(f"{s.name:<16} {state:<8} {s.url}  mlflow run: {run_id or '-'}")


@app.command()
def schema() -> None:
    """JSON Schema of a recipe (for editor completion)."""
    from pipeline.recipe import Recipe

    typer.echo(json.dumps(Recipe.model_json_schema(), indent=2))


@app.command()
def serve(recipe: Path = RecipeArg, set_: list[str] = SetOpt) -> None:
    """Serve the recipe as a Prefect deployment, so runs and "Retry" work from the UI."""
    r = _load(recipe, set_)
    if not os.environ.get("PREFECT_API_URL"):
        _fail("serve needs a Prefect server: start one (`prefect server start`) and set "
              "PREFECT_API_URL=http://127.0.0.1:4200/api", 2)
    from pipeline.flow import pipeline_flow

    pipeline_flow.serve(name=r.name, parameters={"recipe_path": str(recipe.resolve()), "overrides": set_})


@app.command()
def curate(target: list[str] = typer.Argument(..., help="a recipe YAML, or data files/URLs to curate"),
           out: Optional[str] = typer.Option(None, "--out", help="output URL (data mode)"),
           config: Optional[str] = typer.Option(None, "--config", help="curation config YAML (data mode)"),
           only: list[str] = typer.Option([], "--only", help="rerun from this step on, reusing cached "
                                          "earlier steps (repeatable)"),
           benchmarks: Optional[str] = typer.Option(None, "--benchmarks", help="benchmark list YAML/URL "
                                                    "replacing the decontamination list"),
           stage: Optional[str] = typer.Option(None, "--stage", help="which curate stage (recipe mode)"),
           set_: list[str] = SetOpt) -> None:
    """Curate data: a recipe's `curate` stage alone (e.g. decontamination against a new
    benchmark list), or files without a recipe (`--out` required)."""
    from data_curation._base import CurationError

    if benchmarks and "://" not in benchmarks:
        benchmarks = str(Path(benchmarks).resolve())
    is_recipe = len(target) == 1 and target[0].endswith((".yaml", ".yml"))
    try:
        if is_recipe:
            result = _curate_recipe_stage(Path(target[0]), set_, stage, only, benchmarks)
            typer.echo(f"{result.stage}: {result.status} -> {result.url}")
            if result.summary:
                typer.echo(json.dumps(result.summary, indent=2))
            return
        if not out:
            _fail("curate: --out URL is required when curating data files (or give a recipe .yaml)", 2)
        from data_curation.cli import curate_standalone

        report = curate_standalone(target, out, config, only or None, benchmarks)
        typer.echo(json.dumps(report.get("counts", report), indent=2, default=str))
    except CurationError as e:
        _fail(f"curate: {e}", 2)


def _curate_recipe_stage(recipe: Path, overrides: list[str], stage: str | None, only: list[str],
                         benchmarks: str | None):
    """Run one `curate` stage of a recipe with `--only` / `--benchmarks` applied. The stage
    hash follows the (possibly new) benchmark list, so the result is the artifact a recipe
    with that list would use; earlier steps come from the stage's step cache."""
    from pipeline.artifacts import ArtifactError
    from pipeline.execute import StageTarget, execute
    from pipeline.launch import StageFailed
    from pipeline.plan import resolve_references, stage_hash
    from pipeline.tracking import PipelineTracker
    from stages.curate.config import CurateConfig, rerun_config

    r = _load(recipe, overrides)
    p = _plan(r)
    candidates = [s for s in p.stages if s.kind.name == "curate" and (stage is None or s.name == stage)]
    if len(candidates) != 1:
        names = [s.name for s in p.stages if s.kind.name == "curate"]
        _fail(f"curate: recipe {r.name} has curate stages {names or 'none'}; "
              + ("name one with --stage" if names else "add a `kind: curate` stage"), 2)
    s = candidates[0]
    cfg = CurateConfig.model_validate(rerun_config(s.config.model_dump(mode="json"), only or None, benchmarks))
    h = stage_hash(s.kind, cfg, {d: p[d].hash for d in s.deps})
    target = StageTarget(r.name, s.name, s.kind,
                         resolve_references(cfg.model_dump(mode="json"), {d: p[d].url for d in s.deps}),
                         h, p.store.stage_url(s.name, h), {d: (p[d].url, p[d].hash) for d in s.deps},
                         s.resources, s.launcher, r.defaults.seed)
    tracker = PipelineTracker(r.tracking.uri, r.tracking.experiment or r.name, r.name,
                              {"command": "curate", "stage": s.name, "only": only, "benchmarks": benchmarks})
    try:
        result = execute(target, p.store, Path(r.defaults.work_dir), tracker)
    except (StageFailed, ArtifactError) as e:
        tracker.end("FAILED")
        _fail(str(e), 1)
    tracker.end("FINISHED")
    return result


@app.command()
def verify(data: Path = typer.Argument(..., help="task rows (jsonl: domain, prompt, reference, id)"),
           responses: Path = typer.Argument(..., help="responses (jsonl: id, response)"),
           out: Optional[Path] = typer.Option(None, "--out", help="per-row rewards (jsonl)"),
           workers: int = typer.Option(2, "--workers", min=0),
           timeout_s: float = typer.Option(10.0, "--timeout", min=0.1)) -> None:
    """Score model responses with the verifiers registry; prints a per-domain summary."""
    from verifiers.cli import verify_files

    try:
        summary = verify_files(str(data), str(responses), str(out) if out else None, workers, timeout_s)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e), 2)
    typer.echo(json.dumps(summary, indent=2))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
