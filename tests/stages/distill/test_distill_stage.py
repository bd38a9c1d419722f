"""The distill stage end to end (one CPU process through `run_stage`) on the tiny policy (the
suite's base, taught to answer sums and stop): its report equals a recount of the sampled
responses by the verifiers themselves; the kept chats obey the rules and are what `sft`
reads; a run killed after a checkpoint resumes to the same output; a teacher with nothing
accepted fails the stage with the rates; bad rows name their file and line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stages.eval.test_eval_stage import hf_greedy
from tests.stages.stage_kill import kill_after_first_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
K, PER_PROMPT, BATCH = 6, 2, 2
MIN_TOKENS, MAX_TOKENS = 6, 9
CONFIG = {"samples_per_prompt": K, "temperature": 0.1, "max_new_tokens": 24, "min_tokens": MIN_TOKENS,
          "max_tokens": MAX_TOKENS, "max_per_prompt": PER_PROMPT, "batch_prompts": BATCH, "prompt_max_len": 1000,
          "rollout": {"device": "cpu", "max_batch": 16}, "verifier_workers": 1, "seed": 3}


def prompt_rows(tiny_policy) -> list[dict]:
    """12 sums whose reference is the tiny policy's own greedy answer on the even rows (a
    tiny model rarely solves a task: these it solves often when sampling near greedy) and
    the true sum on the odd ones (task family "sums" on the first 6, the domain on the rest), and
    3 countdown puzzles and 2 reasoning-gym leg_counting questions (other verifier domains,
    never taught; reasoning_gym rows name their family in `task`)."""
    from stages.synthetic_data.generators import get_generator
    from verifiers.logic.countdown import generate

    sums = [json.loads(line) for line in tiny_policy["data"].read_text().splitlines()][:12]
    answers = [t.rsplit("</think>", 1)[-1] for t in hf_greedy(tiny_policy["model"], sums)]
    sums = [{**r, "reference": {"answer": a.strip()}} if i % 2 == 0 else r for i, (r, a) in enumerate(zip(sums, answers))]
    sums = [{**r, "task": "sums"} if i < 6 else r for i, r in enumerate(sums)]
    gym = get_generator("reasoning_gym")(2, 1, tasks={"leg_counting": {"config": {"min_animals": 2, "max_animals": 2}}})
    return sums + [{**r, "task": "countdown3"} for r in generate(3, seed=5)] + gym


@pytest.fixture(scope="module")
def distilled(stage_env, tiny_policy, tmp_path_factory):
    from data_curation.urls import local_path
    from pipeline.execute import run_stage

    data = tmp_path_factory.mktemp("distill") / "rows.jsonl"
    rows = prompt_rows(tiny_policy)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {**CONFIG, "teacher": str(tiny_policy["model"]), "data": str(data)}
    run = run_stage("distill", config, stage="distill", storage=stage_env["storage"], recipe="distilltests",
                    work_root=stage_env["work_root"])
    out = Path(local_path(run.url))

    def read(name: str) -> list[dict]:
        return [json.loads(line) for line in (out / name).read_text().splitlines()]

    return {"run": run, "config": config, "rows": rows, "samples": read("samples.jsonl"),
            "chats": read("sft.jsonl"), "out": out}


def test_report_equals_a_recount_by_the_verifiers(distilled):
    from verifiers import verify_batch

    rows, samples, summary = distilled["rows"], distilled["samples"], distilled["run"].summary
    by_id = {str(r["id"]): r for r in rows}
    assert len(samples) == len(rows) * K  # every prompt fits prompt_max_len
    rewards = verify_batch([by_id[s["id"]] for s in samples], [s["response"] for s in samples], num_workers=0)
    assert [r.score for r in rewards] == [s["score"] for s in samples]
    families = {"sums": [], "math": [], "countdown3": [], "leg_counting": []}
    for s, r in zip(samples, rewards):
        families[by_id[s["id"]].get("task", "math")].append((s, r.score))
    for name, items in families.items():
        got = summary["families"][name]
        accepted = sum(score >= 1.0 for _, score in items)
        assert got["samples"] == len(items) and got["prompts"] == len(items) // K
        assert got["accepted"] == accepted and got["acceptance_rate"] == pytest.approx(accepted / len(items))
        assert got["kept"] == sum(c["family"] == name for c in distilled["chats"])
    overall = summary["overall"]
    assert overall["samples"] == len(samples) and overall["kept"] == summary["rows"] == len(distilled["chats"])
    assert summary["domains"]["math"]["samples"] == 12 * K
    # one [metrics] line per batch; the last one's running numbers are the whole run's
    logged = [json.loads(line.split(" ", 1)[1]) for line in
              (distilled["out"] / "logs" / "stage.log").read_text().splitlines() if line.startswith("[metrics] ")]
    assert [m["step"] for m in logged] == list(range(1, summary["batches"] + 1))
    assert logged[-1]["acceptance_rate"] == pytest.approx(overall["acceptance_rate"])
    assert logged[-1]["kept"] == overall["kept"]
    # the policy gives its greedy answer often, not always, and solves no countdown puzzle
    assert 0 < summary["domains"]["math"]["accepted"] < 12 * K
    assert summary["families"]["countdown3"]["accepted"] == 0
    assert summary["domains"]["reasoning_gym"]["samples"] == 2 * K


def test_kept_chats_obey_the_rules(distilled):
    from stages.distill.selection import normalise

    samples, chats = distilled["samples"], distilled["chats"]
    by_prompt: dict[str, list[dict]] = {}
    for s in samples:
        by_prompt.setdefault(s["id"], []).append(s)
    expected_chats = []
    for pid, group in by_prompt.items():
        # a recount of the rules: accepted, finished, in bounds, distinct, at most PER_PROMPT
        eligible = [s for s in group if s["score"] >= 1.0 and s["ended_by_eos"]
                    and MIN_TOKENS <= s["tokens"] <= MAX_TOKENS]
        distinct: dict[str, dict] = {}
        for s in eligible:
            distinct.setdefault(normalise(s["response"]), s)
        expected_chats += [(pid, s["response"]) for s in list(distinct.values())[:PER_PROMPT]]
    assert [(c["prompt_id"], c["messages"][-1]["content"]) for c in chats] == expected_chats
    summary = distilled["run"].summary["overall"]
    # the run met every rule: near-greedy samples repeat, and some accepted ones are too long
    assert summary["kept"] > 0 and summary["verdict_duplicate"] > 0 and summary["verdict_too_long"] > 0
    rows = {str(r["id"]): r for r in distilled["rows"]}
    for c in chats:
        assert [m["role"] for m in c["messages"]] == ["user", "assistant"]
        assert c["messages"][0]["content"] == rows[c["prompt_id"]]["prompt"]
        assert "<think>" in c["messages"][1]["content"]  # the reasoning as the teacher wrote it


def test_the_chats_are_sft_data(distilled):
    """What `sft` reads: every kept chat becomes a sample with trained assistant tokens."""
    from transformers import AutoTokenizer

    from stages.common.rows import input_rows
    from stages.sft.config import SFTData
    from stages.sft.data import build_samples

    tok = AutoTokenizer.from_pretrained(distilled["config"]["teacher"])
    rows = input_rows(lambda p: Path(p), str(distilled["out"] / "sft.jsonl"), keep_bad=True)
    samples, stats = build_samples(rows, tok, 256, "fail", SFTData(path="x"))
    assert len(samples) == stats.samples == len(distilled["chats"]) > 0 and all(s.n_targets > 0 for s in samples)


def test_a_killed_run_resumes_to_the_same_output(stage_env, distilled, tmp_path):
    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.checkpoint_store import CheckpointStore

    recipe = "distillresume"
    kwargs = {"stage": "distill", "storage": stage_env["storage"], "recipe": recipe,
              "work_root": str(stage_env["work_root"])}
    args = {**kwargs, "kind": "distill", "config": distilled["config"], "resources": {}}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.stages.run_stage_process", json.dumps(args)], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stage_dir = kill_after_first_checkpoint(proc, Path(local_path(stage_env["storage"])) / recipe, "distill-*", 200,
                                            "distill")
    assert not (stage_dir / "_SUCCESS").exists()
    done = CheckpointStore(f"file://{stage_dir}", {}).latest()
    batches = -(-len(distilled["rows"]) // BATCH)
    assert done is not None and done < batches  # killed mid-way

    run = run_stage("distill", distilled["config"], **{**kwargs, "work_root": Path(kwargs["work_root"])})
    assert run.summary["resumed_from_batch"] >= done and run.summary["batches"] == batches
    out = Path(local_path(run.url))
    for name in ("samples.jsonl", "sft.jsonl"):
        assert (out / name).read_text() == (distilled["out"] / name).read_text()
    resumed, whole = dict(run.summary), dict(distilled["run"].summary)
    resumed.pop("resumed_from_batch"), whole.pop("resumed_from_batch")
    assert resumed == whole


def test_nothing_accepted_fails_with_the_teacher_and_rates(distilled, tmp_path):
    """One new token at most: a kept response would have to be EOS alone, an empty answer no
    verifier accepts, so nothing can be kept whatever the policy samples."""
    from pipeline.execute import run_stage
    from pipeline.launch import StageFailed

    config = {**distilled["config"], "max_new_tokens": 1, "min_tokens": 1, "max_tokens": None, "limit": 9}
    with pytest.raises(StageFailed) as e:
        run_stage("distill", config, stage="distill_none", storage=str(tmp_path / "store"), work_root=tmp_path / "work")
    msg = str(e.value)
    assert f"teacher {config['teacher']} gave 0 chats, fewer than min_rows=1" in msg
    assert f"0/{9 * K} samples accepted (0.0%)" in msg
    assert f"math 0/{3 * K} accepted (0.0%), 0 kept; sums 0/{6 * K} accepted (0.0%), 0 kept" in msg
    assert not list((tmp_path / "store").rglob("_SUCCESS"))


@pytest.mark.parametrize("bad_row,needle", [
    ({"id": "c1", "domain": "chemistry", "prompt": "What is H2O?", "reference": {"answer": "water"}},
     "domains with no registered verifier (first row of each): {'chemistry': 'c1'}"),
    ({"id": "p1", "domain": "math", "prompt": "What is 1 + 1?"}, "bad.jsonl:2: field 'reference' is missing"),
])
def test_bad_rows_fail_with_file_line_and_field(distilled, tmp_path, bad_row, needle):
    from pipeline.execute import run_stage
    from pipeline.launch import StageFailed

    (tmp_path / "bad.jsonl").write_text(json.dumps(distilled["rows"][0]) + "\n" + json.dumps(bad_row) + "\n")
    config = {**distilled["config"], "data": str(tmp_path / "bad.jsonl")}
    with pytest.raises(StageFailed) as e:
        run_stage("distill", config, stage="distill_bad", storage=str(tmp_path / "store"), work_root=tmp_path / "work")
    assert "distill data" in str(e.value) and needle in str(e.value)
