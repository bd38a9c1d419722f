"""Decontamination as a gate: a stage that declares the evaluation suite it will be judged
on does not start while its input data overlaps that suite above the threshold."""
import json
import re

import pytest

from tests.data_curation.conftest import bench_rows, chat, write_jsonl

FILLER = "Let us reason step by step and check every number twice."


def suite(bench_dir, names=("gsm8k", "aime24"), **kw):
    fields = {"gsm8k": ["question"], "aime24": ["problem"], "math500": ["problem"]}
    return {"benchmarks": [{"path": str(bench_dir / f"{n}.jsonl"), "fields": fields[n], "name": n}
                           for n in names], **kw}


def training_data(tmp_path, bench_dir):
    """Two files: gsm8k line 18 pasted twice, aime24's first problem in a response, a gsm8k
    problem with new numbers (a new problem: no overlap), and clean rows."""
    g, a = bench_rows(bench_dir, "gsm8k"), bench_rows(bench_dir, "aime24")
    renumbered = re.sub(r"\d+", lambda m: str(int(m.group()) + 5), g[30]["question"], count=2)
    sft = write_jsonl(tmp_path / "sft.jsonl", [chat(i, f"Compute {i} + {i}.", FILLER) for i in range(20)] + [
        chat(20, f"Homework: {g[17]['question']}", FILLER), chat(21, "Restate this.", a[0]["problem"]),
        chat(22, renumbered, FILLER), "{not json"])
    rl = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": f"Again: {g[17]['question']}", "reference": "7"}])
    return sft, rl


def test_overlap_names_every_item_and_its_first_copy(tmp_path, bench_dir):
    from stages.common.eval_suite_gate import find_overlap, input_data

    sft, rl = training_data(tmp_path, bench_dir)
    mix = {"data": {"chat": {"path": str(sft), "weight": 1.0}, "math": {"path": [str(rl)], "weight": 0.5}}}
    assert input_data(mix) == [str(sft), str(rl)]
    found = find_overlap(input_data(mix), suite(bench_dir)["benchmarks"])
    assert [(x["benchmark"], x["benchmark_row"], x["benchmark_id"], x["training_rows"]) for x in found["items"]] == [
        ("aime24", 1, "60", 1), ("gsm8k", 18, "17", 2)]
    assert found["items"][1]["first"].endswith("sft.jsonl:21")
    assert found["per_benchmark"] == {"gsm8k": {"items": 1319, "found": 1}, "aime24": {"items": 30, "found": 1}}
    assert found["rows_read"] == 24 and found["rows_unreadable"] == 1


def test_threshold_decides(tmp_path, bench_dir):
    from stages.common.eval_suite_gate import EvalSuiteOverlap, check_eval_suite

    sft, _ = training_data(tmp_path, bench_dir)
    with pytest.raises(EvalSuiteOverlap, match=r"stage 'sft' not started: .*max_overlap = 0.0 "
                                               r"\(gsm8k 1/1319 items, aime24 1/30 items\): "
                                               r"aime24 row 1 \(id 60\) in 1 row\(s\), first at .*sft.jsonl:22"):
        check_eval_suite("sft", {"data": str(sft), "eval_suite": suite(bench_dir)})
    # 1 of 1319 gsm8k items is under 0.1%; 1 of 30 aime24 items is not
    with pytest.raises(EvalSuiteOverlap, match=r"\(aime24 1/30 items\): aime24 row 1"):
        check_eval_suite("sft", {"data": str(sft), "eval_suite": suite(bench_dir, max_overlap=0.001)})
    ok = check_eval_suite("sft", {"data": str(sft), "eval_suite": suite(bench_dir, max_overlap=0.05)})
    assert len(ok["items"]) == 2
    assert check_eval_suite("sft", {"data": str(sft)}) is None
    clean = check_eval_suite("sft", {"data": str(sft), "eval_suite": suite(bench_dir, ["math500"])})
    assert clean["items"] == []
    with pytest.raises(EvalSuiteOverlap, match="has no `data`"):
        check_eval_suite("rm", {"model": "x", "eval_suite": suite(bench_dir)})
    with pytest.raises(EvalSuiteOverlap, match="does not exist"):
        check_eval_suite("sft", {"data": str(tmp_path / "missing.jsonl"), "eval_suite": suite(bench_dir)})


def test_the_pipeline_refuses_to_start_the_stage(tmp_path, bench_dir):
    """Through `run_stage`: the stage is not launched (its model does not even exist), a
    `_FAILED` note names the items, nothing is published; the recipe field validates."""
    from pipeline.artifacts import ArtifactStore
    from pipeline.execute import read_failure, run_stage
    from pipeline.recipe import Recipe
    from stages.common.eval_suite_gate import EvalSuiteOverlap

    sft, _ = training_data(tmp_path, bench_dir)
    config = {"model": str(tmp_path / "no-model"), "data": str(sft), "eval_suite": suite(bench_dir)}
    with pytest.raises(EvalSuiteOverlap, match="gsm8k row 18 \\(id 17\\) in 1 row"):
        run_stage("sft", config, stage="sft", storage=str(tmp_path / "store"), launcher="local",
                  work_root=tmp_path / "work")
    store = ArtifactStore(f"file://{tmp_path}/store/adhoc", {})
    [stage_dir] = [p for p in (tmp_path / "store" / "adhoc").iterdir() if p.name.startswith("sft-")]
    url = f"file://{stage_dir}"
    assert not store.is_done(url)
    assert "not started" in read_failure(store, url)["error"]
    assert not (tmp_path / "work" / "adhoc" / stage_dir.name / "stage.log").exists()
    recipe = {"name": "r", "stages": {"sft": {"kind": "sft", **config}}}
    assert Recipe.model_validate(recipe).stages["sft"].eval_suite.max_overlap == 0
    with pytest.raises(ValueError, match="max_overlap"):
        Recipe.model_validate(json.loads(json.dumps(recipe).replace('"gsm8k"}', '"gsm8k"}').replace(
            '"eval_suite": {', '"eval_suite": {"max_overlap": 1.5, ')))
