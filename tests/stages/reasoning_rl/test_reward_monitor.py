"""reasoning_rl's reward function reports the reward-hacking monitor each step: a policy that
drifts from boxed answers to answers found only by the last-number fallback shows up in the
step's metrics and as a console warning once the share jumps against its history."""
from types import SimpleNamespace

from stages.reasoning_rl.job import SPEC, MonitoredReward

ROWS = [{"prompt": "What is 2+3?", "reference": "5", "domain": "math"}] * 8


def _step(reward, n_fallback: int) -> list:
    texts = ["so the total is 5"] * n_fallback + ["The answer is \\boxed{5}"] * (len(ROWS) - n_fallback)
    return reward(ROWS, texts, ["g"] * len(ROWS))


def test_fallback_jump_is_measured_and_warned(capsys):
    reward = MonitoredReward(SimpleNamespace(verifier_workers=0, verifier_timeout_s=10, ifeval_grading="strict"))
    for _ in range(6):  # a steady history: every answer boxed
        rewards = _step(reward, 0)
        assert all(r.score == 1.0 for r in rewards)
    assert SPEC.step_metrics(reward)["monitor/math/fallback_share"] == 0.0
    assert "warning: reward monitor" not in capsys.readouterr().out

    _step(reward, 8)  # same scores, but all of them through the fallback path
    metrics = SPEC.step_metrics(reward)
    assert metrics["monitor/math/fallback_share"] == 1.0
    assert metrics["monitor/all/pass_rate"] == 1.0  # the reward alone does not show it
    out = capsys.readouterr().out
    assert "reasoning_rl: warning: reward monitor" in out and "fallback_share" in out


def test_ifeval_rows_are_graded_with_the_stages_grading():
    rows = [{"prompt": "List fruit without commas.", "domain": "ifeval",
             "reference": {"instructions": [{"type": "no_commas"}]}}]
    hack = ["Apples\uff0c pears and plums."]  # a full-width comma: the reference does not see it
    for grading, score in (("strict", 0.0), ("reference", 1.0)):
        reward = MonitoredReward(SimpleNamespace(verifier_workers=0, verifier_timeout_s=10, ifeval_grading=grading))
        assert reward(rows, hack, ["g"])[0].score == score
