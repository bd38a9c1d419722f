import json

import pytest

from data_curation._base import CurationError
from data_curation.cli import curate_standalone

from .conftest import bench_rows, chat, read_jsonl, write_jsonl

FILLER = "Step by step: we combine the given numbers carefully and check the result."


def corpus(bench_dir, tmp_path):
    g = bench_rows(bench_dir, "gsm8k")[42]["question"]
    a = bench_rows(bench_dir, "aime24")[3]["problem"]
    rows = [chat(i, f"Compute ${i} \\times {i + 3}$ and explain.", f"It is {i * (i + 3)}. {FILLER}")
            for i in range(30)]
    rows += [chat(30, f"From my worksheet: {g}", FILLER), chat(31, f"Competition: {a}", FILLER),
             rows[4]]
    return write_jsonl(tmp_path / "data.jsonl", rows)


def bench_yaml(tmp_path, bench_dir, names, fname):
    fields = {"gsm8k": "question", "aime24": "problem"}
    path = tmp_path / fname
    path.write_text("".join(f"- {{path: {bench_dir / n}.jsonl, fields: [{fields[n]}], name: {n}}}\n"
                            for n in names))
    return str(path)


def test_standalone_curate_with_config_and_only(tmp_path, bench_dir):
    data = corpus(bench_dir, tmp_path)
    cfg = tmp_path / "curate.yaml"
    cfg.write_text("steps:\n  - step: quality\n  - step: exact_dedup\n  - step: near_dedup\n"
                   "  - step: decontaminate\n    benchmarks: []\n  - step: domain_tag\n"
                   "num_proc: 1\nbatch_size: 16\n")
    out = str(tmp_path / "out")
    with pytest.raises(CurationError, match="benchmark list is empty"):
        curate_standalone([str(data)], out, str(cfg), progress=False)
    rep = curate_standalone([str(data)], out, str(cfg), benchmarks_path=bench_yaml(tmp_path, bench_dir, ["gsm8k"], "b1.yaml"),
                            progress=False)
    assert rep["counts"]["removed_by_step"]["decontaminate"] == 1
    rep2 = curate_standalone([str(data)], out, str(cfg), only=["decontaminate"],
                             benchmarks_path=bench_yaml(tmp_path, bench_dir, ["gsm8k", "aime24"], "b2.yaml"),
                             progress=False)
    assert [s["reused"] for s in rep2["steps"]] == [True] * 4 + [False, False]
    assert rep2["counts"]["removed_by_step"]["decontaminate"] == 2
    flagged = {r["detail"]["benchmark"] for r in read_jsonl(tmp_path / "out" / "removed.jsonl")
               if r["step"] == "decontaminate"}
    assert flagged == {"gsm8k", "aime24"}
    (tmp_path / "bad.yaml").write_text("steps:\n  - step: dedupe\n")
    with pytest.raises(CurationError, match="bad.yaml"):
        curate_standalone([str(data)], out, str(tmp_path / "bad.yaml"), progress=False)
    # no config: the default steps (decontamination only with --benchmarks)
    rep3 = curate_standalone([str(data)], str(tmp_path / "out3"), progress=False)
    assert [s["step"] for s in rep3["steps"]] == ["read", "quality", "exact_dedup", "near_dedup",
                                                   "harmful", "domain_tag"]


@pytest.mark.slow
def test_curate_stage_reuses_step_cache_across_stage_hashes(tmp_path, bench_dir, monkeypatch):
    from pipeline.execute import run_stage
    from pipeline.launch import StageFailed
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
    first = run_stage("curate", base, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", **kw)
    from mlflow.tracking import MlflowClient

    logged = {a.path for a in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(first.run_id, "curation")}
    assert logged == {"curation/report.json", "curation/report.md", "curation/report.html"}
    assert first.summary["removed_by_step"] == {"exact_dedup": 1, "near_dedup": 0, "decontaminate": 1,
                                                "domain_tag": 0}
    art = store / "adhoc" / first.url.rsplit("/", 1)[-1]
    kept = read_jsonl(art / "curated.jsonl")
    assert len(kept) == 31 and all("messages" in r and r["domain"] == "math" for r in kept)
    manifest = json.loads((art / "manifest.json").read_text())
    assert {f["path"] for f in manifest["files"]} >= {"curated.jsonl", "removed.jsonl", "quarantine.jsonl",
                                                       "report.json", "report.md", "report.html"}
    # a new benchmark list: a new stage hash, but only decontaminate and domain_tag are computed
    new = rerun_config(base, only=["decontaminate"],
                       benchmarks=bench_yaml(tmp_path, bench_dir, ["gsm8k", "aime24"], "b2.yaml"))
    CurateConfig.model_validate({**new, "kind": "curate"})
    second = run_stage("curate", new, **kw)
    assert second.hash != first.hash
    assert [s["reused"] for s in second.summary["steps"]] == [True, True, True, False, False]
    assert second.summary["removed_by_step"]["decontaminate"] == 2
    assert (store / "adhoc" / "_curate_cache" / "curate" / "steps").is_dir()
