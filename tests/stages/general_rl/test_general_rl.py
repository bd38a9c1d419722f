"""The general_rl stage: the reward combiner on crafted scores, the prompt mix and the
reasoning set, the config's paper defaults, and a 2-rank run killed with SIGKILL after a
checkpoint that resumes (scheduler, history and the reasoning "before" score restored)."""
from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from stages.general_rl.config import GeneralRLConfig, ReasoningEvalSettings, RewardSettings
from stages.general_rl.prompts import PromptDataError, prompt_row, reasoning_rows
from stages.general_rl.rewards import GeneralReward, ResponseFacts, combine, format_ok, group_normalise
from stages.general_rl.synthetic_prompts import general_prompts, ifeval_prompts
from stages.rl.decoding import Decoded, make_decoder
from tests.stages.conftest import RLHF_MATH, RLHF_PAIRS, TWO
from tests.stages.stage_kill import kill_after_first_checkpoint

REPO = Path(__file__).resolve().parents[3]
# rows in GSM8K's format (a question; a worked answer ending "#### N"), the project's own problems
GSM8K_STYLE = [{"question": f"A farm has {a} hens. {b} are sold and {c} are given away; each hen left lays "
                            f"{k} eggs. How many eggs are laid?",
                "answer": f"{a}-{b}-{c}={a - b - c} hens are left.\n{a - b - c}*{k}={(a - b - c) * k}\n#### {(a - b - c) * k}",
                "idx": i}
               for i, (a, b, c, k) in enumerate([(16, 3, 4, 2), (20, 5, 5, 3), (12, 2, 1, 4), (30, 10, 6, 2),
                                                 (9, 1, 1, 5)])]


def _write_gsm8k_style(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_STYLE))
    return path
GOOD = "<think>ok</think>answer"


# -- the reward combiner ------------------------------------------------------------------------
def test_group_normalise_is_per_group_and_zero_for_degenerate_groups():
    z = group_normalise([1.0, 3.0, 10.0, 10.0, 7.0], ["a", "a", "b", "b", "c"])
    assert z[0] == pytest.approx(-1.0, abs=1e-5) and z[1] == pytest.approx(1.0, abs=1e-5)
    assert z[2:] == [0.0, 0.0, 0.0]  # equal scores / a group of one say nothing
    z = group_normalise([0.0, 1.0, 2.0, 100.0, 200.0, 300.0], [1, 1, 1, 2, 2, 2])
    assert z[:3] == pytest.approx(z[3:], abs=1e-5)  # scale-free within a group (up to eps)


def test_combine_weights_every_term():
    s = RewardSettings(rm_weight=2.0, rule_weight=3.0, format_penalty=0.5, truncation_penalty=1.0,
                       overlong_buffer=10, overlong_penalty=0.4, rm_on_verified=True)
    facts = [ResponseFacts("g", n_tokens=5), ResponseFacts("g", format_ok=False, format_why="x", n_tokens=95),
             ResponseFacts("g", truncated=True, n_tokens=100), ResponseFacts("h", n_tokens=1)]
    rm = [1.0, 3.0, 2.0, 50.0]
    out = combine(rm, [1.0, 0.5, None, 0.0], facts, s, max_len=100)
    z = group_normalise(rm[:3], ["g"] * 3)
    assert out[0].score == pytest.approx(2 * z[0] + 3.0)
    assert out[1].score == pytest.approx(2 * z[1] + 1.5 - 0.5 - 0.4 * 0.5)  # half the overlong buffer used
    assert out[2].score == pytest.approx(2 * z[2] - 1.0 - 0.4)             # no rule term (no reference)
    assert out[3].score == pytest.approx(0.0)                              # alone in its group, rule 0
    assert out[1].parts["format"] == -0.5 and "format: x" in out[1].reason
    assert out[2].parts["rm_raw"] == 2.0 and "rule" not in out[2].parts and "truncated" in out[2].reason
    raw = combine(rm, [None] * 4, facts, RewardSettings(rm_normalization="none", format_penalty=0,
                                                          truncation_penalty=0), max_len=100)
    assert [r.score for r in raw] == rm
    with pytest.raises(ValueError, match="responses"):
        combine([1.0], [None, None], facts[:2], s, 100)


def test_format_check():
    assert format_ok(GOOD, True) == (True, "")
    assert not format_ok("answer only", True)[0] and format_ok("answer only", False)[0]
    assert format_ok("<think>a</think>  ", True) == (False, "empty answer")
    assert not format_ok("<think>a</think>b</think>c", True)[0]
    assert not format_ok("</think>b<think>", False)[0]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def test_general_reward_calls_the_rm_and_the_verifiers_and_remembers_lengths():
    decode = make_decoder(FakeTokenizer(), eos_ids=[0])
    finished, cut = decode([ord(c) for c in GOOD] + [0]), decode([ord(c) for c in "<think>never"])
    assert str(finished) == GOOD and finished.ended_by_eos and finished.n_tokens == len(GOOD) + 1
    assert not cut.ended_by_eos
    assert pickle.loads(pickle.dumps(finished)).n_tokens == finished.n_tokens  # crosses broadcast_object_list
    calls = {}

    class Scorer:
        def score(self, prompts, responses):
            calls["rm"] = (prompts, responses)
            return [float(len(r)) for r in responses]

    def verify_batch(rows, responses, num_workers, timeout_s):
        calls["verify"] = [r["id"] for r in rows]
        return [SimpleNamespace(score=1.0, reason="followed") for _ in rows]

    msgs = [{"role": "user", "content": "q"}]
    rows = [{"id": "a", "messages": msgs, "reference": {"instructions": []}, "domain": "ifeval", "source": "s"},
            {"id": "a", "messages": msgs, "reference": {"instructions": []}, "domain": "ifeval", "source": "s"},
            {"id": "b", "messages": msgs, "reference": None, "domain": "general", "source": "t"}]
    reward = GeneralReward(RewardSettings(rm_on_verified=True), max_len=64, scorer=Scorer(),
                           verify_batch=verify_batch)
    out = reward(rows, [finished, Decoded(GOOD + "!!", 9, True), cut], ["g0", "g0", "g1"])
    assert calls["verify"] == ["a", "a"] and calls["rm"][0] == [msgs] * 3
    assert calls["rm"][1][0] == GOOD and type(calls["rm"][1][0]) is str
    assert out[0].parts["rule"] == 1.0 and out[1].parts["rm"] > 0 > out[0].parts["rm"]
    assert out[2].parts == {"rm_raw": float(len("<think>never")), "rm": 0.0, "format": -0.5, "truncation": -1.0}
    assert reward.last_batch[1] == out
    with pytest.raises(ValueError, match="scorer"):
        GeneralReward(RewardSettings(), max_len=64)


def test_by_default_the_rm_judges_only_what_no_verifier_scored():
    """A row with a reference is judged by its verifier alone: the RM is not asked about it, and
    an RM that prefers the wrong answer cannot outweigh the check (a z-scored RM term has unit
    spread in a group, a 0/1 rule term at most 0.5). With rule_weight 0 the RM judges every row."""
    asked = []

    class WrongTaste:  # prefers the longer response, here the wrong one
        def score(self, prompts, responses):
            asked.extend(responses)
            return [float(len(r)) for r in responses]

    def verify_batch(rows, responses, num_workers, timeout_s):
        return [SimpleNamespace(score=float(r.endswith("4")), reason="") for r in responses]

    msgs = [{"role": "user", "content": "2+2"}]
    math_row = {"id": "m", "messages": msgs, "reference": "4", "domain": "math", "source": "s"}
    chat_row = {"id": "c", "messages": msgs, "reference": None, "domain": "general", "source": "t"}
    right, wrong = Decoded("<think>x</think>4", 5, True), Decoded("<think>xxxxxxxx</think>5", 9, True)
    chat_a, chat_b = Decoded("<think>x</think>hi", 5, True), Decoded("<think>x</think>hello", 6, True)
    rows, texts, groups = [math_row, math_row, chat_row, chat_row], [right, wrong, chat_a, chat_b], ["m", "m", "c", "c"]
    out = GeneralReward(RewardSettings(), max_len=64, scorer=WrongTaste(), verify_batch=verify_batch)(rows, texts, groups)
    assert asked == [str(chat_a), str(chat_b)]                      # the math rows never went to the RM
    assert out[0].score > out[1].score and "rm" not in out[0].parts  # the verifier decides the math group
    assert out[3].parts["rm"] > 0 > out[2].parts["rm"]              # the RM still judges chat
    asked.clear()
    both = GeneralReward(RewardSettings(rm_on_verified=True, rm_weight=1.0), max_len=64, scorer=WrongTaste(),
                         verify_batch=verify_batch)(rows, texts, groups)
    assert len(asked) == 4 and both[0].score < both[1].score           # what the default prevents
    asked.clear()
    rm_only = GeneralReward(RewardSettings(rule_weight=0.0), max_len=64, scorer=WrongTaste(),
                            verify_batch=verify_batch)(rows, texts, groups)
    assert len(asked) == 4 and "rm" in rm_only[0].parts


def test_rm_score_is_normalised_per_grpo_group_not_per_prompt():
    """A prompt drawn twice in a step makes two GRPO groups: each is z-scored on its own, so
    one group's RM scores do not shift the other's (they did when pooled by prompt id)."""
    class Scorer:
        def score(self, prompts, responses):
            return [float(r.count("!")) for r in responses]

    msgs = [{"role": "user", "content": "q"}]
    rows = [{"id": "same-prompt", "messages": msgs, "reference": None, "domain": "general", "source": "s"}] * 4
    texts = [Decoded(GOOD + "!" * n, 5, True) for n in (0, 1, 10, 20)]
    settings = RewardSettings(rule_weight=0.0, format_penalty=0.0)
    out = GeneralReward(settings, max_len=64, scorer=Scorer())(rows, texts, ["g0", "g0", "g1", "g1"])
    z = group_normalise([0.0, 1.0, 10.0, 20.0], ["g0", "g0", "g1", "g1"])
    assert [r.score for r in out] == pytest.approx(z)
    assert [r.score for r in out[:2]] == pytest.approx([r.score for r in out[2:]], abs=1e-5)  # scale-free per group
    pooled = group_normalise([0.0, 1.0, 10.0, 20.0], ["same-prompt"] * 4)
    assert out[0].score != pytest.approx(pooled[0])


# -- prompts, the reasoning set, the config --------------------------------------------------------
def test_prompt_rows_of_every_format():
    known = {"ifeval", "math"}
    assert prompt_row({"prompt": "hi"}, "f row 1", known)["domain"] == "general"
    magpie = prompt_row({"instruction": "Write", "response": "..."}, "w", known)
    assert magpie["messages"] == [{"role": "user", "content": "Write"}]
    chat = prompt_row({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                    {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
                      "w", known)
    assert [m["content"] for m in chat["messages"]] == ["a", "b", "c"] and chat["prompt"] == "c"
    pref = prompt_row({"prompt": "Q?", "chosen": "x", "rejected": "y", "reference": None}, "w", known)
    assert pref["messages"] == [{"role": "user", "content": "Q?"}] and pref["reference"] is None
    assert prompt_row({"prompt": "Q?", "chosen": "x", "rejected": "x"}, "w", known) is None  # a bad pair
    ifeval = ifeval_prompts(4, 0)
    rows = [prompt_row(r, "w", known) for r in ifeval]
    assert all(r["domain"] == "ifeval" and r["reference"]["instructions"] for r in rows)
    assert all(r["reference"] is None for r in (prompt_row(g, "w", known) for g in general_prompts(3, 0)))
    for bad, msg in [({"text": "x"}, "no prompt"), ({"prompt": "x", "reference": {"answer": "1"}}, "no `domain`"),
                     ({"prompt": "x", "domain": "poetry", "reference": {}}, "has no verifier"),
                     ({"messages": [{"role": "system", "content": "s"}]}, "no user turn")]:
        with pytest.raises(PromptDataError, match=msg) as e:
            prompt_row(bad, "data.jsonl row 7", known)
        assert "data.jsonl row 7" in str(e.value)


def test_reasoning_rows_from_gsm8k_fields():
    raw = [dict(r) for r in GSM8K_STYLE]
    ev = ReasoningEvalSettings(data="gsm8k.jsonl", limit=3, prompt_field="question", answer_field="answer",
                               answer_regex=r"####\s*(.+)$", instruction="Put the answer in \\boxed{}.")
    rows = reasoning_rows(raw, ev, "gsm8k.jsonl")
    assert len(rows) == 3 and rows[0]["reference"] == {"answer": "18"} and rows[0]["domain"] == "math"
    assert rows[0]["prompt"].endswith("\\boxed{}.") and rows[0]["id"] == "0"
    from verifiers import verify

    assert verify(rows[0], "<think>16-3-4=9, 9*2</think>\\boxed{18}").score == 1.0
    with pytest.raises(PromptDataError, match="row 1.*'problem'"):
        reasoning_rows(raw, ev.model_copy(update={"prompt_field": "problem"}), "gsm8k.jsonl")


def test_reasoning_rows_keep_their_own_domain_unless_the_recipe_names_one():
    # RL-format rows (the recipe's held-out reasoning_gym set): the guard must score each row with
    # its own domain's verifier; round 12's guard scored reasoning_gym rows with the math verifier
    raw = [{"id": "a", "domain": "reasoning_gym", "prompt": "q1", "reference": {"task": "gcd", "answer": "6"}},
           {"id": "b", "prompt": "q2", "reference": {"answer": "4"}}]
    rows = reasoning_rows(raw, ReasoningEvalSettings(data="heldout.jsonl"), "heldout.jsonl")
    assert [r["domain"] for r in rows] == ["reasoning_gym", "math"]
    forced = reasoning_rows(raw, ReasoningEvalSettings(data="heldout.jsonl", domain="math"), "heldout.jsonl")
    assert [r["domain"] for r in forced] == ["math", "math"]


def test_config_defaults_are_the_papers_general_rl_numbers():
    base = {"kind": "general_rl", "model": "m", "data": {"chat": {"path": "p"}}, "steps": 1,
            "reward_model": "rm", "reasoning_eval": None}
    cfg = GeneralRLConfig.model_validate(base)
    assert (cfg.lr, cfg.kl_coef, cfg.temperature, cfg.prompts_per_step, cfg.rollouts_per_prompt, cfg.max_len) == \
        (3e-6, 0.0, 1.0, 80, 8, 32768)
    assert cfg.adam_betas == (0.9, 0.999) and cfg.weight_decay == 0.01
    assert cfg.correction in ("icepop", "tis", "none") and cfg.scheduler in ("c3po", "sync")
    for change, msg in [({"reward_model": None}, "needs reward_model"),
                        ({"domain_weights": {"math": 1.0}}, "weights prompt sources"),
                        ({"data": {"a": {"path": "p", "weight": 0}}}, "positive weight"),
                        ({"reward": {"rm_weight": 0, "rule_weight": 0}}, "both 0"),
                        ({"reasoning_eval": {"data": "x", "max_new_tokens": 40000}}, "exceeds max_len"),
                        ({"reasoning_eval": {"data": "x", "answer_regex": "####"}}, "capturing group")]:
        with pytest.raises(ValueError, match=msg):
            GeneralRLConfig.model_validate({**base, **change})
    missing = {k: v for k, v in base.items() if k != "reasoning_eval"}
    with pytest.raises(ValueError, match="reasoning_eval"):
        GeneralRLConfig.model_validate(missing)


# -- the stage: kill -9 after a checkpoint, resume --------------------------------------------------
STEPS = 6  # checkpoints at 3 and 6: the kill lands after 3, the resume runs 4..6


def _metrics(log: Path) -> list[dict]:
    return [json.loads(line.split("[metrics] ", 1)[1]) for line in log.read_text().splitlines()
            if "[metrics] " in line]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_general_rl_killed_after_checkpoint_resumes(tiny_rm, rlhf_data, base_artifact, stage_env):
    from mlflow.tracking import MlflowClient

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.artifact_inputs import read_manifest
    from stages.common.checkpoint_store import CheckpointStore

    root = rlhf_data.prefs.parent
    chat, ifeval = root / "chat.jsonl", root / "ifeval.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in general_prompts(8, 0)))
    ifeval.write_text("".join(json.dumps(r) + "\n" for r in ifeval_prompts(8, 0)))
    config = {
        "model": "${stages.base.output}", "reward_model": "${stages.rm.output}",
        "data": {"chat": {"path": str(chat), "weight": 1.0}, "ifeval": {"path": str(ifeval), "weight": 1.0},
                 "preference": {"path": str(rlhf_data.prefs), "weight": 0.5},
                 "math": {"path": str(rlhf_data.math), "weight": 0.5}},
        "steps": STEPS, "prompts_per_step": 2, "rollouts_per_prompt": 4, "max_len": 24, "prompt_max_len": 256,
        "c3po": {"pool_capacity": 8, "token_budget": 48}, "lr": 1e-4, "micro_batch_tokens": 1024,
        "rollout": {"max_batch": 8}, "verifier_workers": 0, "checkpoint_every": 3, "sample_rollouts": 0,
        "reward": {"rm_device": "cpu", "rm_batch_size": 8},
        "reasoning_eval": {"data": str(_write_gsm8k_style(root / "gsm8k_style.jsonl")), "limit": 3, "prompt_field": "question", "answer_field": "answer",
                           "answer_regex": r"####\s*(.+)$", "max_new_tokens": 16},
    }
    recipe = "grlresume"
    # torchrun starts the ranks faster than deepspeed's runner; the stage is the same either way
    kwargs = dict(stage="grl", storage=stage_env["storage"], recipe=recipe, work_root=str(stage_env["work_root"]),
                  launcher="torchrun", upstream={"base": base_artifact.url, "rm": tiny_rm.url})
    args = {**kwargs, "kind": "general_rl", "config": config, "resources": {"cpu_ranks": 2}}
    proc = subprocess.Popen([sys.executable, "-m", "tests.stages.run_stage_process", json.dumps(args)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    stage_root = Path(local_path(stage_env["storage"])) / recipe
    stage_dir = kill_after_first_checkpoint(proc, stage_root, "grl-*", 300, "general_rl")
    assert not (stage_dir / "_SUCCESS").exists()
    resumed_at = CheckpointStore(f"file://{stage_dir}", {}).latest()
    assert resumed_at is not None and resumed_at % 3 == 0 and resumed_at < STEPS
    run1 = _metrics(next((stage_env["work_root"] / recipe).glob("grl-*/*/stage.log")))
    before1 = [m for m in run1 if "reasoning_eval/accuracy_before" in m]
    assert len(before1) == 1 and before1[0]["step"] == 0

    result = run_stage("general_rl", config, resources=TWO, tracking_uri=stage_env["tracking_uri"], **kwargs)
    out = Path(local_path(result.url))
    log2 = (out / "logs" / "stage.log").read_text()
    run2 = _metrics(out / "logs" / "stage.log")
    assert [m["step"] for m in run2 if "policy_version" in m] == list(range(resumed_at + 1, STEPS + 1))
    assert "reasoning set before training" not in log2  # the "before" score came from the checkpoint
    s = result.summary
    assert s["resumed_from_step"] == resumed_at and s["steps"] == STEPS  # history restored, not restarted
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    # scheduler counters continued across the kill
    assert s["groups_trained"] == sum(h["groups_trained"] for h in history)
    assert s["prompts_per_source"] == {"chat": 8, "ifeval": 8, "preference": RLHF_PAIRS, "math": RLHF_MATH}
    # every response was judged once: by its verifier (rows with a reference) or by the RM
    assert all(h.get("reward_part_rate/rm_raw", 0) + h.get("reward_part_rate/rule", 0) == pytest.approx(1.0)
               for h in history)
    assert any(h.get("reward_part_rate/rule", 0) > 0 for h in history)
    assert any(h.get("reward_part_rate/rm_raw", 0) > 0 for h in history)
    assert all(math.isfinite(h["loss"]) for h in history)
    # the reasoning guard: before (from run 1, via the checkpoint), after, delta; manifest + MLflow
    guard = s["reasoning_eval"]
    assert guard["rows"] == 3 and guard["accuracy_before"] == pytest.approx(before1[0]["reasoning_eval/accuracy_before"])
    assert guard["delta"] == pytest.approx(guard["accuracy_after"] - guard["accuracy_before"])
    assert s["reasoning_delta"] == guard["delta"]
    assert read_manifest(result.url)["summary"]["reasoning_eval"]["delta"] == guard["delta"]
    client = MlflowClient(stage_env["tracking_uri"])
    assert [m.value for m in client.get_metric_history(result.run_id, "reasoning_eval/delta")] == \
        [pytest.approx(guard["delta"])]
    # the policy moved and is a loadable HF dir
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(Path(local_path(base_artifact.url)))
    assert any((a - b).abs().max() > 0 for a, b in zip(model.parameters(), base.parameters()))
