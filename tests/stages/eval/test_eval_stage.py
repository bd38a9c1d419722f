"""The eval stage end to end (one CPU process through `run_stage`): two models (an upstream
artifact and a user's own checkpoint dir), greedy and sampled decodings; its greedy responses
are transformers' own greedy responses, and its accuracy is the known one of a set built from
the policy's answers; errors in the sets name the file, line and field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.mlflow_db import tracking_uri

pytestmark = pytest.mark.slow

ROWS, SAMPLES, MAX_NEW = 12, 4, 24


def hf_greedy(model_dir: Path, rows: list[dict]) -> list[str]:
    """Greedy responses by transformers' generate (not the rollout engine)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.common.chat import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    for row in rows:
        ids = encode_prompt(tok, [{"role": "user", "content": row["prompt"]}])
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        texts.append(tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True))
    return texts


def test_eval_scores_two_models_greedy_and_sampled(stage_env, base_artifact, base_dir, tiny_policy, tmp_path):
    """The set's references are the policy's own greedy answers for the first half of the rows
    and another number for the second half, so its right greedy accuracy is exactly 0.5."""
    from mlflow.tracking import MlflowClient

    from data_curation.urls import local_path
    from pipeline.execute import run_stage

    prompts = [json.loads(line) for line in tiny_policy["data"].read_text().splitlines()][:ROWS]
    answers = [t.rsplit("</think>", 1)[-1].strip() for t in hf_greedy(tiny_policy["model"], prompts)]
    assert all(a.isdigit() for a in answers), answers  # the policy answers in its trained format
    rows = [{**p, "reference": {"answer": a if i < ROWS // 2 else str(int(a) + 1)}}
            for i, (p, a) in enumerate(zip(prompts, answers))]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"models": {"policy": str(tiny_policy["model"]), "base": "${stages.base.output}"},
              "sets": {"sums": str(tmp_path / "set.jsonl")},
              "decodings": {"greedy": {}, "sampled": {"temperature": 1.0, "samples": SAMPLES, "pass_at": [1, SAMPLES]}},
              "max_new_tokens": MAX_NEW, "prompt_max_len": 64, "rollout": {"device": "cpu", "max_batch": 16},
              "verifier_workers": 0}
    uri = tracking_uri(tmp_path)
    run = run_stage("eval", config, stage="eval", storage=stage_env["storage"], recipe=stage_env["recipe"],
                    upstream={"base": base_artifact.url}, work_root=stage_env["work_root"], tracking_uri=uri)
    summary = run.summary
    responses = [json.loads(line) for line in (Path(local_path(run.url)) / "responses.jsonl").read_text().splitlines()]
    assert len(responses) == 2 * ROWS * (1 + SAMPLES)

    def of(model: str, decoding: str, key: str) -> list:
        return [r[key] for r in responses if (r["model"], r["decoding"]) == (model, decoding)]

    # the engine's greedy responses are transformers' greedy responses, for both models
    assert of("policy", "greedy", "response") == hf_greedy(tiny_policy["model"], rows)
    assert of("base", "greedy", "response") == hf_greedy(base_dir, rows)
    assert of("policy", "greedy", "score") == [1.0] * (ROWS // 2) + [0.0] * (ROWS - ROWS // 2)
    assert summary["accuracy"]["policy"]["sums"]["greedy"] == 0.5

    records = {(r["model"], r["decoding"], r["domain"]): r for r in summary["results"]}
    for model in ("policy", "base"):
        assert summary["accuracy"][model]["sums"]["greedy"] == pytest.approx(sum(of(model, "greedy", "score")) / ROWS)
        assert records[(model, "greedy", "all")]["rows"] == ROWS
        assert records[(model, "greedy", "math")]["accuracy"] == records[(model, "greedy", "all")]["accuracy"]
        assert records[(model, "greedy", "all")]["eos_fraction"] == pytest.approx(
            sum(of(model, "greedy", "ended_by_eos")) / ROWS)
        sampled = records[(model, "sampled", "all")]
        assert sampled["responses"] == ROWS * SAMPLES
        assert sampled["accuracy"] == pytest.approx(sum(of(model, "sampled", "score")) / (ROWS * SAMPLES))
        assert sampled["pass_at_1"] <= sampled[f"pass_at_{SAMPLES}"]
    assert len(set(of("policy", "sampled", "response"))) > 1  # sampled, not the greedy response four times

    client = MlflowClient(uri)
    run_id = client.search_runs(client.get_experiment_by_name("adhoc").experiment_id)[0].info.run_id
    logged = client.get_run(run_id).data.metrics
    assert logged["policy/sums/greedy/all/accuracy"] == 0.5
    assert f"base/sums/sampled/math/pass_at_{SAMPLES}" in logged


@pytest.mark.parametrize("bad_row,needle", [
    ({"id": "c1", "domain": "chemistry", "prompt": "What is H2O?", "reference": {"answer": "water"}},
     "domains with no registered verifier (first row of each): {'chemistry': 'c1'}"),
    ({"id": "p1", "domain": "math", "reference": {"answer": "1"}}, "bad.jsonl:2: field 'prompt'"),
])
def test_bad_sets_fail_with_file_line_and_field(tiny_policy, tmp_path, bad_row, needle):
    from pipeline.execute import run_stage
    from stages.common.contract import StageFailed

    good = json.loads(tiny_policy["data"].read_text().splitlines()[0])
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad_row) + "\n")
    config = {"models": {"policy": str(tiny_policy["model"])}, "sets": {"mine": str(tmp_path / "bad.jsonl")},
              "max_new_tokens": 8, "rollout": {"device": "cpu"}, "verifier_workers": 0}
    with pytest.raises(StageFailed) as e:
        run_stage("eval", config, stage="eval_bad", storage=str(tmp_path / "store"), work_root=tmp_path / "work")
    assert "eval set 'mine'" in str(e.value) and needle in str(e.value)
