"""`ring-pipeline ...`: the user's entry point. Nothing imports this module."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from data_curation._base import CurationError
from data_curation.cli import curate_standalone
from pipeline.changes import code_drift, previous_manifest, why_rerun
from pipeline.console import RunConsole, Verbosity, installed
from pipeline.execute import ExecutionPolicy, StageTarget, execute
from pipeline.gc import GcPolicy, find_leftovers, remove
from pipeline.launch import build_command
from pipeline.loader import RecipeError, check_endpoints, load_recipe
from pipeline.orchestrate import run_recipe
from pipeline.plan import make_plan
from pipeline.recipe import Recipe
from pipeline.shipped_recipes import ShippedRecipeError, locate, shipped_names, write_recipes
from pipeline.speed import resolve_stage_speed
from pipeline.status import stage_state
from pipeline.tracking import PipelineTracker, timestamped
from stages.common import secrets
from stages.common.artifact_inputs import ArtifactError
from stages.common.contract import StageFailed

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
def _main(ctx: typer.Context,
          version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_version,
                                       help="print the version and exit")) -> None:
    """Run the Ring-1T training recipe as one declarative pipeline."""
    ctx.with_resource(secrets.redact_console())  # no credential of a recipe reaches the terminal

def _locate_recipe(recipe: Path) -> Path:
    try:
        return locate(recipe)
    except ShippedRecipeError as e:
        raise typer.BadParameter(str(e)) from None


RecipeArg = typer.Argument(..., help="recipe YAML file, or the name of a shipped recipe (e.g. tiny)",
                           callback=_locate_recipe)
SetOpt = typer.Option([], "--set", help="override a recipe value: KEY.PATH=VALUE (repeatable)")


def _fail(message: str, code: int) -> None:
    typer.secho(message, err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def _load(recipe: Path, overrides: list[str], probe: bool = False):
    """The recipe; with `probe`, also whether its store and tracking server answer."""
    try:
        r = load_recipe(recipe, overrides)
        if probe:
            check_endpoints(r)
        return r
    except RecipeError as e:
        _fail("recipe error:\n" + "\n".join(f"  {p}" for p in e.problems), 2)


def _plan(recipe):
    try:
        return make_plan(recipe)
    except ArtifactError as e:  # store unreachable, bad credentials, an input that cannot be listed
        _fail(str(e), 2)


@app.command()
def init(directory: Path = typer.Argument(Path("."), help="where to write recipes/ (default: here)"),
         force: bool = typer.Option(False, "--force", help="overwrite recipe files that exist")) -> None:
    """Write the shipped recipes into DIRECTORY/recipes/, to read, copy and edit."""
    try:
        written = write_recipes(directory, overwrite=force)
    except ShippedRecipeError as e:
        _fail(f"init: {e}", 2)
    typer.echo(f"wrote {len(written)} files to {directory / 'recipes'}: {', '.join(shipped_names())}")
    typer.echo(f"next: cd {directory} && ring-pipeline run recipes/tiny.yaml")


@app.command()
def validate(recipe: Path = RecipeArg, set_: list[str] = SetOpt,
             offline: bool = typer.Option(False, "--offline", help="do not contact the store and the "
                                          "tracking server (form only)")) -> None:
    """Check a recipe (schema, values, references, cycles) without running anything; then
    whether its store and tracking server answer (reachable, credentials accepted)."""
    r = _load(recipe, set_, probe=not offline)
    typer.echo(f"{recipe}: ok ({len(r.stages)} stages: {', '.join(r.stages)})")


@app.command()
def plan(recipe: Path = RecipeArg, set_: list[str] = SetOpt) -> None:
    """Stages in order with their hashes, what is done / to run and why, and each launch command."""
    r = _load(recipe, set_)
    try:
        p, unknown = make_plan(r), None
        dirs = p.store.stage_dirs()
    except ArtifactError as e:  # planning must work where the store is out of reach
        p, unknown, dirs = make_plan(r, check_store=False), str(e), {}
    typer.echo(f"recipe {p.recipe.name}  store {p.store.root}")
    if unknown:
        typer.secho(f"store not reachable ({unknown}): done / to run unknown", fg=typer.colors.YELLOW)
    unhashable: set[str] = set()  # an input (or an upstream's) could not be fingerprinted
    for i, s in enumerate(p.stages, 1):
        if any(fp.kind == "unreachable" for fp in s.inputs.values()) or unhashable.intersection(s.deps):
            unhashable.add(s.name)
        status = "?" if unknown else "done" if s.done else "to run"
        short = "?" * 12 if s.name in unhashable else s.short_hash
        typer.echo(f"{i:>2}. {s.name:<16} {s.kind.name:<14} {short}  {status:<7} "
                   f"needs: {', '.join(s.deps) or '-'}")
        typer.echo(f"    artifact: {s.url if s.name not in unhashable else '? (its hash needs the inputs)'}")
        for name, fp in s.inputs.items():
            typer.echo(f"    input:    {name}  ({fp.summary})")
        cmd = build_command(s.kind.entry, Path("<job.json>"), s.resources, s.launcher, s.kind.distributed, s.ray)
        typer.echo(f"    launch:   {' '.join(cmd)}  (world size {s.resources.world_size if s.kind.distributed else 1})")
        _echo_speed(s, p.store.storage_options)
        if unknown:
            continue
        try:
            if s.done:
                drift = code_drift(s.name, s.kind, p.store.read_manifest(s.url))
                if drift:
                    typer.secho(f"    warning:  {drift}", fg=typer.colors.YELLOW)
            else:
                previous = previous_manifest(p.store, dirs.get(s.name, []), s.url)
                inputs = {k: fp.as_dict() for k, fp in s.inputs.items()}
                for reason in why_rerun(s.hashed, inputs, previous):
                    typer.echo(f"    why:      {reason}")
        except ArtifactError as e:
            typer.secho(f"    error:    {e}", fg=typer.colors.YELLOW)


def _echo_speed(s, storage_options: dict) -> None:
    """The stage's `auto` speed settings as decided for this machine (pipeline/speed.py)."""
    speed = resolve_stage_speed(s.kind, s.resolved_config(), s.resources, s.launcher, storage_options, s.ray)
    if speed is None or not speed.choices:
        return
    typer.echo(f"    speed:    {speed.summary()}")
    typer.echo(f"              on {speed.hw.describe()}, {speed.world} training rank(s); rules: "
               f"{', '.join(c.rule for c in speed.choices)}")
    if s.launcher == "ray" and speed.hw.device == "cuda":  # which cluster's GPUs these are
        typer.echo(f"              {speed.hw.note}")
    for note in speed.notes:
        typer.echo(f"              {note}")


def _resume_hint(recipe: Path, overrides: list[str], outcome) -> str:
    import shlex

    command = shlex.join(["ring-pipeline", "run", str(recipe), *[a for o in overrides for a in ("--set", o)]])
    hint = (f"resume with: {command}\n(published stages are skipped; an interrupted stage resumes "
            "from its last checkpoint)")
    if outcome.deployment:
        hint += (f"\nor retry flow run {outcome.flow_run_id} from the Prefect UI: it runs where "
                 f"`ring-pipeline serve {recipe}` serves deployment {outcome.deployment}")
    return hint


@app.command()
def run(recipe: Path = RecipeArg, set_: list[str] = SetOpt,
        only: list[str] = typer.Option([], "--only", help="run just this stage (repeatable)"),
        from_: Optional[str] = typer.Option(None, "--from", help="rerun this stage and everything after it"),
        force: list[str] = typer.Option([], "--force", help="rerun this stage (and its dependents)"),
        no_wait: bool = typer.Option(False, "--no-wait", help="fail instead of waiting when another "
                                     "run is executing a stage"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="only each stage's start and finish, and errors"),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="also every line of every stage job "
                                     "and Prefect's own logs")) -> None:
    """Run the recipe as a Prefect flow; published stages are skipped.

    Per stage: a start line, a progress line, a finish line; a failed stage is reported once,
    and every failed stage is listed at the end (exit 1). Stage output is in each stage's
    log. Ctrl-C or SIGTERM stops every running stage job (exit 130 / 143); nothing is published."""
    from pipeline.flow import PipelineFailed  # imports Prefect (~800 modules): only a run needs it

    if quiet and verbose:
        _fail("run: --quiet and --verbose exclude each other", 2)
    r = _load(recipe, set_, probe=True)
    p = _plan(r)
    try:
        selected, forced = p.select(only, from_, force)
    except KeyError as e:
        _fail(str(e.args[0]), 2)
    unavailable = p.unavailable_benchmarks(selected, forced)
    if unavailable:
        _fail("benchmark sets this run needs cannot be read here; no stage was started:\n"
              + "\n".join(f"  {line}" for line in unavailable), 2)
    params = {"recipe_path": str(recipe.resolve()), "overrides": list(set_), "only": only or None,
              "from_stage": from_, "force": force or None, "wait_if_running": not no_wait}
    verbosity = Verbosity.QUIET if quiet else Verbosity.VERBOSE if verbose else Verbosity.NORMAL
    with installed(RunConsole(verbosity)):
        outcome = run_recipe(params, r.name, Path(r.defaults.work_dir), verbosity)
    if outcome.interrupted:
        _fail(f"interrupted ({outcome.interrupted}): running stage jobs were stopped and nothing "
              f"unfinished was published\n{_resume_hint(recipe, set_, outcome)}", outcome.exit_code)
    error = outcome.error
    if isinstance(error, PipelineFailed):
        _list_results(error.results)
        for name, failure in error.failures.items():
            typer.secho(f"{name}: FAILED, {failure.summary()}" + (f"  (log: {failure.log})" if failure.log else ""),
                        err=True, fg=typer.colors.RED)
        for name in error.not_started:
            typer.secho(f"{name}: not started (an upstream stage failed)", err=True, fg=typer.colors.RED)
        # only store errors (outage, permissions) or stages busy elsewhere (--no-wait): the
        # user's to fix outside any stage, like a recipe error
        store_only = all(f.category in ("store error", "busy") for f in error.failures.values())
        _fail(f"{error}\n{_resume_hint(recipe, set_, outcome)}", 2 if store_only else 1)
    if isinstance(error, StageFailed):
        _fail(f"{error}\n{_resume_hint(recipe, set_, outcome)}", 1)
    if isinstance(error, ArtifactError):
        _fail(f"{error}\n{_resume_hint(recipe, set_, outcome)}", 2)
    if error is not None:
        raise error
    _list_results(outcome.results or {})


def _list_results(results: dict) -> None:
    for name, res in results.items():
        extra = f" in {res['seconds']:.1f}s" if res["status"] == "ran" else ""
        typer.echo(f"{name}: {res['status']}{extra} -> {res['url']}")


@app.command()
def status(recipe: Path = RecipeArg, set_: list[str] = SetOpt) -> None:
    """Per stage: done / running / failed / interrupted / pending, its artifact URI and MLflow run."""
    p = _plan(_load(recipe, set_))
    for s in p.stages:
        st = stage_state(p.store, s)
        typer.echo(f"{s.name:<16} {st.state:<11} {s.url}  mlflow run: {st.run_id or '-'}")
        for line in (st.detail or "").splitlines():
            typer.echo(f"    {line}")
        for w in st.warnings:
            typer.secho(f"    warning: {w}", fg=typer.colors.YELLOW)


@app.command()
def gc(recipe: Path = RecipeArg, set_: list[str] = SetOpt,
       delete: bool = typer.Option(False, "--delete", help="remove what is listed (default: dry run)"),
       keep_checkpoints: Optional[int] = typer.Option(None, "--keep-checkpoints", min=0,
                                                      help="per published artifact (default: the "
                                                      "recipe's storage.keep_checkpoints)"),
       keep_artifacts: int = typer.Option(1, "--keep-artifacts", min=0, help="earlier artifacts kept "
                                          "per stage besides the current plan's"),
       older_than: float = typer.Option(7.0, "--older-than", min=0, help="days unchanged before an "
                                        "unreferenced artifact or unfinished attempt is removed")) -> None:
    """List (or with --delete remove) work dirs, checkpoints and artifacts nothing needs."""
    r = _load(recipe, set_)
    p = _plan(r)
    policy = GcPolicy(r.storage.keep_checkpoints if keep_checkpoints is None else keep_checkpoints,
                      keep_artifacts, older_than * 86400)
    try:
        leftovers = find_leftovers(p, Path(r.defaults.work_dir), policy)
        for item in leftovers:
            typer.echo(f"{'removing' if delete else 'would remove'} {item.what:<10} {item.location}  "
                       f"({item.reason})")
        if delete:
            remove(p, leftovers)
    except ArtifactError as e:
        _fail(str(e), 2)
    typer.echo(f"{len(leftovers)} {'removed' if delete else 'to remove (dry run: add --delete)'}")


@app.command()
def schema() -> None:
    """JSON Schema of a recipe (for editor completion)."""
    typer.echo(json.dumps(Recipe.model_json_schema(), indent=2))


@app.command()
def serve(recipe: Path = RecipeArg, set_: list[str] = SetOpt) -> None:
    """Serve the recipe as a Prefect deployment, so runs and "Retry" work from the UI."""
    r = _load(recipe, set_)
    if not os.environ.get("PREFECT_API_URL"):
        _fail("serve needs a Prefect server: start one (`prefect server start`) and set "
              "PREFECT_API_URL=http://127.0.0.1:4200/api", 2)
    from pipeline.flow import pipeline_flow  # imports Prefect (~800 modules): only serve needs it

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
        report = curate_standalone(target, out, config, only or None, benchmarks)
        typer.echo(json.dumps(report.get("counts", report), indent=2, default=str))
    except CurationError as e:
        _fail(f"curate: {e}", 2)


def _curate_recipe_stage(recipe: Path, overrides: list[str], stage: str | None, only: list[str],
                         benchmarks: str | None):
    """Run one stage of a recipe whose kind reruns under this command (`StageKind.rerun_config`:
    the `curate` kind) with `--only` / `--benchmarks` applied. The stage hash follows the
    (possibly new) benchmark list, so the result is the artifact a recipe with that list would
    use; earlier steps come from the stage's step cache."""
    r = _load(recipe, overrides)
    rerunnable = [s for s in _plan(r).stages if s.kind.rerun_config is not None]
    candidates = [s for s in rerunnable if stage is None or s.name == stage]
    if len(candidates) != 1:
        names = [s.name for s in rerunnable]
        _fail(f"curate: recipe {r.name} has curate stages {names or 'none'}; "
              + ("name one with --stage" if names else "add a `kind: curate` stage"), 2)
    s = candidates[0]
    rerun = s.kind.config.model_validate(s.kind.rerun_config(s.config.model_dump(mode="json"), only or None,
                                                             benchmarks))
    p = _plan(r.model_copy(update={"stages": {**r.stages, s.name: rerun}}))
    target = StageTarget.of(p[s.name])
    tracker = PipelineTracker(r.tracking.uri, r.tracking.experiment or r.name, timestamped(f"{r.name} curate"),
                              {"command": "curate", "stage": s.name, "only": only, "benchmarks": benchmarks},
                              tags={"ring.recipe": r.name}, artifact_location=r.tracking.artifact_location,
                              ui_url=r.tracking.ui_url)
    try:
        result = execute(target, p.store, Path(r.defaults.work_dir), ExecutionPolicy.of(r.storage), tracker)
    except StageFailed as e:
        tracker.end("FAILED")
        _fail(str(e), 1)
    except ArtifactError as e:
        tracker.end("FAILED")
        _fail(str(e), 2)
    tracker.end("FINISHED")
    return result


@app.command()
def verify(data: Path = typer.Argument(..., help="task rows (jsonl: domain, prompt, reference, id)"),
           responses: Path = typer.Argument(..., help="responses (jsonl: id, response)"),
           out: Optional[Path] = typer.Option(None, "--out", help="per-row rewards (jsonl)"),
           workers: int = typer.Option(2, "--workers", min=0),
           timeout_s: float = typer.Option(10.0, "--timeout", min=0.1)) -> None:
    """Score model responses with the verifiers registry; prints a per-domain summary."""
    from verifiers.cli import verify_files  # the verifiers package, ~0.1 s: only this command needs it

    try:
        summary = verify_files(str(data), str(responses), str(out) if out else None, workers, timeout_s)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e), 2)
    typer.echo(json.dumps(summary, indent=2))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
