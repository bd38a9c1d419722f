"""The curate stage through the pipeline: a stage job, its step cache, its artifacts."""
import json

import pytest

from tests.data_curation.conftest import read_jsonl
from tests.data_curation.test_cli import bench_yaml, corpus
from tests.mlflow_db import tracking_uri


@pytest.mark.slow
def test_curate_stage_reuses_step_cache_across_stage_hashes(tmp_path, bench_dir, monkeypatch):
    from pipeline.execute import run_stage
    from stages.common.contract import StageFailed
    from stages.curate.config import CurateConfig, rerun_config

    monkeypatch.chdir(tmp_path)   # MLflow's default artifact root is ./mlruns
    data = corpus(bench_dir, tmp_path)
    store = tmp_path / "store"
    base = {"data": [str(data)], "num_proc": 1, "progress": False,
            "steps": [{"step": "exact_dedup"}, {"step": "near_dedup"},
                      {"step": "decontaminate", "benchmarks": bench_yaml(tmp_path, bench_dir, ["gsm8k"], "b1.yaml")},
                      {"step": "domain_tag"}]}
    kw = dict(stage="curate", storage=str(store), launcher="local", work_root=tmp_path / "work")
    with pytest.raises(StageFailed, match="run the full curation"):
        run_stage("curate", rerun_config(base, only=["decontaminate"]), **kw)
    uri = tracking_uri(tmp_path)
    first = run_stage("curate", base, tracking_uri=uri, **kw)
    from mlflow.tracking import MlflowClient

    logged = {a.path for a in MlflowClient(uri).list_artifacts(first.run_id, "curation")}
    assert logged == {"curation/report.json", "curation/report.md", "curation/report.html",
                      "curation/contamination.json"}
    metrics = MlflowClient(uri).get_run(first.run_id).data.metrics
    assert metrics["contamination.decontaminate.gsm8k.items_found"] == 1
    assert first.summary["removed_by_step"] == {"exact_dedup": 1, "near_dedup": 0, "decontaminate": 1,
                                                "domain_tag": 0}
    art = store / "adhoc" / first.url.rsplit("/", 1)[-1]
    kept = read_jsonl(art / "curated.jsonl")
    assert len(kept) == 31 and all("messages" in r and r["domain"] == "math" for r in kept)
    manifest = json.loads((art / "manifest.json").read_text())
    assert {f["path"] for f in manifest["files"]} >= {"curated.jsonl", "removed.jsonl", "quarantine.jsonl",
                                                       "report.json", "report.md", "report.html",
                                                       "contamination.json"}
    found = json.loads((art / "contamination.json").read_text())["steps"][0]["items"]
    assert [(x["benchmark"], x["benchmark_row"], x["training_rows"]) for x in found] == [("gsm8k", 43, 1)]
    assert first.summary["contamination_items_found"] == {"decontaminate.gsm8k": 1}
    # keeping fewer rows than min_rows fails the stage, saying where the rows went
    with pytest.raises(StageFailed, match=r"kept 31 of 33 input rows, fewer than min_rows = 32: "
                                          r"removed by step: exact_dedup 1, decontaminate 1"):
        run_stage("curate", {**base, "min_rows": 32}, **kw)
    # a new benchmark list: a new stage hash, but only decontaminate and domain_tag are computed
    new = rerun_config(base, only=["decontaminate"],
                       benchmarks=bench_yaml(tmp_path, bench_dir, ["gsm8k", "aime24"], "b2.yaml"))
    CurateConfig.model_validate({**new, "kind": "curate"})
    second = run_stage("curate", new, **kw)
    assert second.hash != first.hash
    assert [s["reused"] for s in second.summary["steps"]] == [True, True, True, False, False]
    assert second.summary["removed_by_step"]["decontaminate"] == 2
    assert (store / "adhoc" / "_curate_cache" / "curate" / "steps").is_dir()
