"""Storage and manifest errors are user errors: they name the URL and the operation, a failed
publish leaves a `_FAILED` note, and `status` / `plan` never crash on them."""
from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from pipeline.artifacts import ArtifactStore
from pipeline.cli import app
from stages.common.artifact_inputs import ArtifactError, read_manifest
from tests.mlflow_db import tracking_uri

runner = CliRunner()

RECIPE = """\
name: errs
storage: {{url: "{url}", options: {options}}}
defaults: {{work_dir: "{work}"}}
stages:
  data:
    kind: synthetic_data
    files: {{sft.jsonl: {{generator: arithmetic_cot, n: 5}}}}
"""


def _recipe(tmp_path, url, options=None):
    p = tmp_path / "errs.yaml"
    p.write_text(textwrap.dedent(RECIPE.format(url=url, options=json.dumps(options or {}),
                                               work=tmp_path / "work")))
    return p


@pytest.mark.parametrize("damage", ["not json", "[]", None], ids=["garbage", "not-a-manifest", "missing"])
def test_corrupt_manifest_is_named_and_status_survives(tmp_path, damage):
    from pipeline.loader import load_recipe
    from pipeline.plan import make_plan

    recipe = _recipe(tmp_path, f"file://{tmp_path}/store")
    plan = make_plan(load_recipe(recipe))
    src = tmp_path / "out"
    src.mkdir()
    (src / "sft.jsonl").write_text("{}\n")
    plan.store.publish(src, plan["data"].url, {"stage": "data"})
    manifest = tmp_path / "store" / "errs" / plan["data"].url.rsplit("/", 1)[-1] / "manifest.json"
    if damage is None:
        manifest.unlink()
    else:
        manifest.write_text(damage)
    with pytest.raises(ArtifactError, match=f"{plan['data'].url}.*(corrupt|no manifest.json).*--force"):
        read_manifest(plan["data"].url)
    res = runner.invoke(app, ["status", str(recipe)])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert res.output.split()[1] == "error" and "--force" in res.output
    res = runner.invoke(app, ["plan", str(recipe)])
    assert res.exit_code == 0 and "error:" in res.output and "Traceback" not in res.output, res.output


def test_unreachable_store_names_url_and_operation(tmp_path, unreachable_port):
    opts = {"endpoint_url": f"http://127.0.0.1:{unreachable_port}", "key": "k", "secret": "s",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    recipe = _recipe(tmp_path, "s3://down-bucket/runs", opts)
    res = runner.invoke(app, ["status", str(recipe)])
    assert res.exit_code == 2, res.output
    assert "cannot check for _SUCCESS at s3://down-bucket/runs/errs/data-" in res.output, res.output
    assert "Traceback" not in res.output
    res = runner.invoke(app, ["plan", str(recipe)])
    assert res.exit_code == 0 and "store not reachable" in res.output and " data " in res.output, res.output


@pytest.mark.slow
def test_failed_publish_writes_failed_note_and_a_clean_message(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.execute import adhoc_target, run_stage
    from stages.common.artifact_inputs import StorageError

    config = {"files": {"sft.jsonl": {"generator": "arithmetic_cot", "n": 5}}}
    storage, uri = f"file://{tmp_path}/store", tracking_uri(tmp_path)
    target = adhoc_target("synthetic_data", config, stage="data", storage=storage)
    # the store refuses the upload: where the log directory goes, a file is in the way
    stage_dir = tmp_path / "store" / "adhoc" / target.url.rsplit("/", 1)[-1]
    stage_dir.mkdir(parents=True)
    (stage_dir / "logs").write_text("in the way")
    with pytest.raises(StorageError, match=rf"cannot publish to {target.url}: \w+Error"):
        run_stage("synthetic_data", config, stage="data", storage=storage, tracking_uri=uri,
                  work_root=tmp_path / "work")
    assert not (stage_dir / "_SUCCESS").exists()
    failed = json.loads((stage_dir / "_FAILED").read_text())
    assert failed["type"] == "StorageError" and "cannot publish to" in failed["error"]
    assert not (stage_dir / "_RUNNING").exists()  # the lease is released
    (run,) = [r for r in MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("adhoc").experiment_id]) if r.data.tags.get("ring.stage")]
    assert run.info.status == "FAILED"
    store = ArtifactStore(f"{storage}/adhoc", {})
    assert store.read_note(target.url, "_FAILED")["attempt"]
