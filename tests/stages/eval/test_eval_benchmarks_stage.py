"""The eval stage on a benchmark file as it is (GSM8K through its field mapping) and on an
lm-eval task defined on local data (lm-eval's `hf` backend on the stage's model), one run
through `run_stage`; the lm-eval task's targets are built so its exact_match is known (0.5)
whatever the tiny model generates: its filter's regex matches nothing, so every filtered
answer is lm-eval's fallback "[invalid]", which half of the targets are."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stages.common.contract import StageError
from stages.eval.benchmarks import GSM8K_EXTRACTION
from stages.eval.harness import require_lm_eval
from tests.mlflow_db import tracking_uri

TASK = {"task": "local_sums", "output_type": "generate_until", "doc_to_text": "Q: {{question}}\nA:",
        "doc_to_target": "{{target}}", "generation_kwargs": {"until": ["\n"], "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "filter_list": [{"name": "never", "filter": [{"function": "regex", "regex_pattern": "QQ(\\d+)ZZ"},
                                                     {"function": "take_first"}]}]}


@pytest.mark.slow
def test_eval_stage_scores_gsm8k_as_it_is_and_a_local_lm_eval_task(stage_env, base_artifact, tmp_path, benchmark_sets):
    pytest.importorskip("lm_eval")
    from mlflow.tracking import MlflowClient

    from data_curation.urls import local_path
    from pipeline.execute import run_stage

    data = tmp_path / "local.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1", "target": "[invalid]" if i % 2 else str(i + 1)}) + "\n"
                            for i in range(4)))
    config = {"models": {"base": "${stages.base.output}"},
              "sets": {"gsm8k": {"hub": "openai/gsm8k", "config": "main", "split": "test", "limit": 3, "question_field": "question",
                                 "answer_field": "answer", "answer_extractor": "gsm8k", "id_field": "idx",
                                 "extraction": GSM8K_EXTRACTION},
                       "harness": {"lm_eval": TASK, "data": str(data), "max_new_tokens": 4, "batch_size": 4}},
              "max_new_tokens": 8, "prompt_max_len": 512, "rollout": {"device": "cpu"}, "verifier_workers": 0}
    uri = tracking_uri(tmp_path)
    run = run_stage("eval", config, stage="eval_bench", storage=stage_env["storage"], recipe=stage_env["recipe"],
                    upstream={"base": base_artifact.url}, work_root=stage_env["work_root"], tracking_uri=uri)
    summary = run.summary
    responses = [json.loads(line) for line in (Path(local_path(run.url)) / "responses.jsonl").read_text().splitlines()]
    assert [r["id"] for r in responses] == [0, 1, 2] and {r["set"] for r in responses} == {"gsm8k"}
    gsm8k = {(r["set"], r["domain"]): r for r in summary["results"] if r["decoding"] == "greedy"}
    assert gsm8k[("gsm8k", "all")]["rows"] == 3
    assert summary["accuracy"]["base"]["gsm8k"]["greedy"] == sum(r["score"] for r in responses) / 3

    metrics = summary["lm_eval"]["base"]["harness"]
    assert metrics["exact_match,never"] == 0.5 and metrics["sample_len"] == 4
    (record,) = [r for r in summary["results"] if r["decoding"] == "lm_eval"]
    assert record["set"] == "harness" and record["exact_match,never"] == 0.5
    client = MlflowClient(uri)
    run_id = client.search_runs(client.get_experiment_by_name("adhoc").experiment_id)[0].info.run_id
    logged = client.get_run(run_id).data.metrics
    assert logged["base/harness/lm_eval/exact_match/never"] == 0.5
    assert "base/gsm8k/greedy/all/accuracy" in logged


def test_lm_eval_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(StageError, match=r"eval set 'h' .* needs lm-evaluation-harness.*\[lm-eval\]"):
        require_lm_eval("eval set 'h' (an lm-eval task)")


def test_task_without_its_required_keys_is_named(tmp_path):
    pytest.importorskip("lm_eval")
    from stages.eval.config import LmEvalSet
    from stages.eval.harness import _task_config

    spec = LmEvalSet(lm_eval={"output_type": "generate_until"}, data=str(tmp_path / "d.jsonl"))
    with pytest.raises(StageError, match=r"sets.h.lm_eval: the task config has no 'doc_to_text'"):
        _task_config(spec, "h", lambda p: Path(p))
    bad = tmp_path / "task.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(StageError, match=rf"sets.h.lm_eval = {bad}: lm-eval cannot read the task YAML .*"
                                         r"Expected YAML dict"):
        _task_config(LmEvalSet(lm_eval=str(bad)), "h", lambda p: Path(p))
    ok = _task_config(LmEvalSet(lm_eval=TASK, data=str(tmp_path / "d.jsonl"), split="dev", max_new_tokens=5), "h",
                      lambda p: Path(p))
    assert ok["dataset_path"] == "json" and ok["test_split"] == "dev" and ok["task"] == "local_sums"
    assert ok["dataset_kwargs"] == {"data_files": {"dev": str(tmp_path / "d.jsonl")}}
    assert ok["generation_kwargs"]["max_gen_toks"] == 5 and ok["generation_kwargs"]["until"] == ["\n"]


def test_shipped_gsm8k_task_is_lm_evals_own_scoring_over_local_data(tmp_path):
    """recipes/lm_eval/gsm8k_local.yaml scores as lm-eval's gsm8k task does (the filters and
    metric the agreement check applies), over a local GSM8K file."""
    import yaml

    from stages.eval.config import LmEvalSet
    from stages.eval.harness import _task_config, gsm8k_scorer

    pytest.importorskip("lm_eval")
    repo = Path(__file__).resolve().parents[3]
    ours = _task_config(LmEvalSet(lm_eval=str(repo / "recipes/lm_eval/gsm8k_local.yaml"),
                                  data=str(tmp_path / "gsm8k.jsonl")), "g", lambda p: Path(p))
    _, theirs = gsm8k_scorer()
    for key in ("filter_list", "metric_list", "doc_to_text", "doc_to_target", "output_type"):
        assert ours[key] == theirs[key], key
    assert ours["generation_kwargs"]["until"] == theirs["generation_kwargs"]["until"]
    assert ours["num_fewshot"] == 0 and "fewshot_split" not in ours and "training_split" not in ours
    assert yaml.safe_load((repo / "recipes/lm_eval/gsm8k_local.yaml").read_text())["task"] == "gsm8k_local"


def _task_dir(tmp_path: Path) -> Path:
    """A task the way lm-eval's own are written: a shared base (`include:`, relative) and the
    prompt from a function of a module beside the YAML (`!function`)."""
    d = tmp_path / "tasks"
    (d / "common").mkdir(parents=True)
    (d / "common" / "base.yaml").write_text(yaml_dump({k: v for k, v in TASK.items() if k != "doc_to_text"}))
    (d / "prompts.py").write_text("def question(doc):\n    return 'Question: ' + doc['question'].upper() + '?'\n")
    (d / "task.yaml").write_text("include: common/base.yaml\ntask: local_sums_fn\n"
                                 "doc_to_text: !function prompts.question\n")
    return d


def yaml_dump(obj) -> str:
    import yaml
    return yaml.safe_dump(obj, sort_keys=False)


def test_a_task_yaml_with_includes_and_functions_reads_as_lm_eval_reads_it(tmp_path):
    """`include:` relative to the YAML and `!function` of a module beside it, as lm-eval's own
    tasks use them: the task lm-eval builds from the config prompts with the function and keeps
    the included filters and metric; a missing include or module names the set and the file."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from stages.eval.config import LmEvalSet
    from stages.eval.harness import _task_config

    d = _task_dir(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1", "target": str(i + 1)}) + "\n" for i in range(3)))
    config = _task_config(LmEvalSet(lm_eval=str(d / "task.yaml"), data=str(data)), "h", lambda p: Path(p))
    assert config["task"] == "local_sums_fn" and config["filter_list"] == TASK["filter_list"]
    (task,) = TaskManager(include_defaults=False).load([config])["tasks"].values()
    doc = next(iter(task.test_docs()))
    assert task.doc_to_text(doc) == "Question: 0 + 1?" and task.doc_to_target(doc) == "1"

    (d / "task.yaml").write_text("include: common/missing.yaml\ntask: t\n")
    with pytest.raises(StageError, match=rf"sets.h.lm_eval = {d}/task.yaml: {d}/common/missing.yaml, included by "
                                         rf"the task YAML {d}/task.yaml .*does not exist"):
        _task_config(LmEvalSet(lm_eval=str(d / "task.yaml")), "h", lambda p: Path(p))
    (d / "task.yaml").write_text("include: common/base.yaml\ntask: t\ndoc_to_text: !function nowhere_module.fn\n")
    with pytest.raises(StageError, match=rf"sets.h.lm_eval = {d}/task.yaml: lm-eval cannot read the task YAML "
                                         r".*ImportError: .*nowhere_module"):
        _task_config(LmEvalSet(lm_eval=str(d / "task.yaml")), "h", lambda p: Path(p))
