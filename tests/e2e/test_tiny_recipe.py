"""The README's main job, as a stranger does it: in a clone of the repository in an empty
directory (nothing beside it, no benchmarks directory, an empty offline hub cache, the clone's
own code), every shipped recipe validates and plans, and `ring-pipeline run recipes/tiny.yaml`
runs the whole paper pipeline on CPU with 2 ranks reading nothing outside the clone; then a
second run that skips everything, then decontamination alone against a new benchmark list."""
from __future__ import annotations

import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.shipped_recipes import shipped_names
from tests.conftest import REPO
from tests.e2e.clone import clone_repository, paths_outside, stranger_env

pytestmark = [pytest.mark.slow, pytest.mark.long_pole]  # the recipe end to end: ~4-5 minutes

STAGES = ["data", "curate", "base", "sft", "reasoning_rl", "reward_model", "general_rl"]
SFT_STEPS = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())["stages"]["sft"]["max_steps"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The repository cloned into an empty directory: every command below runs there."""
    return clone_repository(tmp_path_factory.mktemp("stranger"))


def _cli(*args, tmp_path, cwd, timeout=900, prefect_api=None, overrides=True):
    """`ring-pipeline` in the clone `cwd`, its store, MLflow DB and work dir in tmp_path; with the
    embedded Prefect server unless `prefect_api` names a server (the suite's shared one, where the
    embedded one is not the claim)."""
    env = stranger_env(tmp_path)
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    sets = ["--set", f"storage.url=file://{tmp_path}/store",
            "--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            "--set", f"defaults.work_dir={tmp_path}/work",
            "--set", "storage.keep_checkpoints=1"] if overrides else []
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *args, *sets], cwd=cwd,
                         capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr


def _manifest(tmp_path, stage):
    (path,) = glob.glob(f"{tmp_path}/store/tiny/{stage}-*/manifest.json")
    return json.loads(open(path).read())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, embedded_prefect_home, clone):
    tmp_path = tmp_path_factory.mktemp("tiny")
    rc, out = _cli("run", "recipes/tiny.yaml", tmp_path=tmp_path, cwd=clone)
    assert rc == 0, out[-6000:]
    return tmp_path, out


def test_every_shipped_recipe_validates_and_plans_in_the_clone(clone, tmp_path):
    names = shipped_names()
    assert {"tiny", "gpu-small", "ring1t", "smollm2-reasoning"} <= set(names)
    for name in names:
        rc, out = _cli("validate", "--offline", f"recipes/{name}.yaml", tmp_path=tmp_path, cwd=clone, overrides=False)
        assert rc == 0, (name, out[-3000:])
        rc, out = _cli("plan", f"recipes/{name}.yaml", tmp_path=tmp_path, cwd=clone)
        assert rc == 0 and "1. " in out, (name, out[-3000:])


def test_the_tiny_run_read_nothing_outside_the_clone(tiny_run, clone):
    tmp_path, _ = tiny_run
    for stage in STAGES:
        manifest = _manifest(tmp_path, stage)
        # every external input the plan fingerprinted, and every path in the stage's config, is in
        # the clone or where the command line put the store and work dirs
        assert paths_outside(list(manifest.get("inputs", {})), [clone]) == [], (stage, manifest.get("inputs"))
        assert paths_outside(manifest["config"], [clone, tmp_path]) == [], (stage, manifest["config"])
        assert not any(key.startswith("benchmark ") for key in manifest.get("inputs", {})), stage


def test_whole_recipe_runs_and_each_stage_does_its_job(tiny_run):
    tmp_path, out = tiny_run
    for stage in STAGES:
        assert f"{stage}: ran" in out, out[-3000:]
    sft = _manifest(tmp_path, "sft")["summary"]
    assert sft["world_size"] == 2 and sft["steps"] == SFT_STEPS
    # the stage kept its last two checkpoints while training; the published artifact keeps one
    assert len(glob.glob(f"{tmp_path}/store/tiny/sft-*/checkpoints/step-*")) == 1
    assert sft["final_loss"] < sft["first_loss"] - 2.0  # the tiny model learns the task
    curate = _manifest(tmp_path, "curate")["summary"]
    assert curate["kept"] + curate["removed"] + curate["quarantined"] == curate["input_rows"]
    # the decontamination gate ran against the recipe's own held-out set and removed SFT rows holding its problems
    assert curate["contamination_items_found"]["decontaminate.reasoning_eval"] >= 1
    assert curate["removed_by_step"]["decontaminate"] >= curate["contamination_items_found"]["decontaminate.reasoning_eval"]
    rl = _manifest(tmp_path, "reasoning_rl")["summary"]
    assert rl["steps"] == 6 and rl["carried_over_finished"] >= 1  # C3PO++ carried rollouts over
    rm = _manifest(tmp_path, "reward_model")["summary"]
    assert rm["eval_accuracy"] > rm["eval_accuracy_initial"]
    grl = _manifest(tmp_path, "general_rl")
    assert set(grl["summary"]["reasoning_eval"]) >= {"accuracy_before", "accuracy_after", "delta"}
    assert grl["upstream"].keys() == {"reasoning_rl", "data", "reward_model"}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = glob.glob(f"{tmp_path}/store/tiny/general_rl-*")[0]
    # the policy is a ring_moe: its custom code travelled with every model artifact
    assert {p.name for p in Path(model_dir).glob("*_ring_moe.py")} == {"configuration_ring_moe.py",
                                                                      "modeling_ring_moe.py"}
    AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)


def test_the_console_fits_on_one_screen(tiny_run):
    tmp_path, out = tiny_run
    lines = out.splitlines()
    # per stage a start line, a finish line and a few progress lines; the stage jobs' own
    # output (metric JSON, launcher chatter, tqdm bars) is in their logs
    assert len(lines) <= 50, out
    assert not any(marker in out for marker in ("[metrics]", "[INFO]", "[WARNING]", "Loading weights", "Task run")), out
    for stage in STAGES:
        assert sum(ln.startswith(f"{stage} ") and " started " in ln for ln in lines) == 1, (stage, out)
        (done,) = [ln for ln in lines if ln.startswith(f"{stage} ") and " done in " in ln]
        assert f"-> file://{tmp_path}/store/tiny/{stage}-" in done, done
    headline = {ln.split()[0]: ln for ln in lines if " done in " in ln}
    assert re.search(r"loss [\d.]+ -> [\d.]+", headline["sft"])
    assert "reward/mean" in headline["reasoning_rl"] and "eval/accuracy" in headline["reward_model"]
    assert f"kept {_manifest(tmp_path, 'curate')['summary']['kept']}," in headline["curate"]


def test_tracking_has_a_parent_run_and_a_nested_run_per_stage(tiny_run):
    from mlflow.tracking import MlflowClient

    tmp_path, _ = tiny_run
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name == "tiny"]
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("ring.kind") == "pipeline"]
    assert len(parents) == 1
    parent = parents[0]
    assert re.fullmatch(r"tiny \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", parent.info.run_name)
    assert parent.data.tags["mlflow.note.content"].startswith("Ring-1T pipeline smoke on CPU")
    assert len(parent.data.tags["mlflow.source.git.commit"]) == 40 and parent.data.tags["prefect.flow_run_id"]
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "recipe")} == \
        {"recipe/tiny.yaml", "recipe/resolved.yaml"}
    assert exp.artifact_location == (tmp_path / "mlartifacts").as_uri()  # beside the DB, not ./mlruns
    stage_runs = {r.data.tags["ring.stage"]: r for r in runs
                  if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(stage_runs) == set(STAGES)
    assert all(r.info.status == "FINISHED" for r in stage_runs.values())
    sft = stage_runs["sft"]
    assert sft.data.params["lr"] == "0.005"
    losses = client.get_metric_history(sft.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, SFT_STEPS + 1))
    assert "stage.log" in {a.path for a in client.list_artifacts(sft.info.run_id)}
    # the main curves of each training stage, plotted when it ended
    for stage in ("sft", "reasoning_rl", "reward_model", "general_rl"):
        assert [a.path for a in client.list_artifacts(stage_runs[stage].info.run_id, "plots")] == \
            [f"plots/{stage}.png"], stage
    inputs = {d.dataset.name: d.dataset for d in sft.inputs.dataset_inputs}
    assert set(inputs) == {"base", "curate/curated.jsonl"}
    assert _manifest(tmp_path, "curate")["hash"][:12] == inputs["curate/curated.jsonl"].digest


def test_second_run_skips_every_stage_and_status_says_done(tiny_run, prefect_api, clone):
    from mlflow.tracking import MlflowClient

    tmp_path, _ = tiny_run
    # the first run was on the embedded server; this one skips on the suite's shared server
    rc, out = _cli("run", "recipes/tiny.yaml", tmp_path=tmp_path, cwd=clone, prefect_api=prefect_api)
    assert rc == 0, out[-3000:]
    for stage in STAGES:
        assert f"{stage}: skipped" in out
    # a run in which nothing ran leaves no (empty) parent run in MLflow
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert len([r for r in runs if r.data.tags.get("ring.kind") == "pipeline"]) == 1
    rc, out = _cli("status", "recipes/tiny.yaml", tmp_path=tmp_path, cwd=clone)
    assert rc == 0
    assert sum(1 for line in out.splitlines() if " done " in line) == len(STAGES), out


def test_decontamination_alone_against_a_new_benchmark_list(tiny_run, tmp_path, clone):
    store, _ = tiny_run
    curated = glob.glob(f"{store}/store/tiny/curate-*/curated.jsonl")[0]
    leaked = json.loads(open(curated).readline())["messages"][0]["content"]
    bench = tmp_path / "new_bench.jsonl"
    bench.write_text(json.dumps({"question": leaked}) + "\n")
    blist = tmp_path / "benchmarks.yaml"
    blist.write_text(f"- {{name: leaked, path: {bench}, fields: [question]}}\n")
    rc, out = _cli("curate", "recipes/tiny.yaml", "--only", "decontaminate", "--benchmarks", str(blist),
                   tmp_path=store, cwd=clone)
    assert rc == 0, out[-3000:]
    dirs = sorted(glob.glob(f"{store}/store/tiny/curate-*"))
    assert len(dirs) == 2  # a new artifact for the new list; the recipe's own one is untouched
    new = next(d for d in dirs if json.load(open(f"{d}/manifest.json"))["config"]["only"])
    summary = json.load(open(f"{new}/manifest.json"))["summary"]
    reused = {s["step"]: s["reused"] for s in summary["steps"]}
    assert reused["quality"] and reused["exact_dedup"] and reused["near_dedup"]
    assert not reused["decontaminate"]
    assert summary["removed_by_step"]["decontaminate"] >= 1
