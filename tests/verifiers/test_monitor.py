"""Reward-hacking monitors: metrics of real verifier rewards, and jump warnings."""
import random

import pytest

from verifiers import verify
from verifiers.monitor import RewardMonitor, jump_warnings, step_metrics

MATH = {"domain": "math", "reference": {"answer": "42"}}


def math_step(rng, n, fallback_share, pass_rate):
    """Real rewards: passing answers either boxed or found by the last-number fallback."""
    rewards, lengths = [], []
    for _ in range(n):
        if rng.random() < pass_rate:
            text = "</think> so it is 42" if rng.random() < fallback_share else r"</think> \boxed{42}"
        else:
            text = r"</think> \boxed{41}"
        rewards.append(verify(MATH, text))
        lengths.append(rng.randint(50, 500))
    return rewards, lengths


def test_metrics_per_domain_from_real_rewards():
    rewards = [verify(MATH, r"</think> \boxed{42}"), verify(MATH, "</think> it is 42 then"),
               verify(MATH, r"</think> \boxed{7}"),
               verify({"domain": "countdown", "reference": {"numbers": [1, 2], "target": 3}}, "</think> 1 + 2")]
    m = step_metrics(rewards, [10, 20, 30, 40])
    assert m["math/n"] == 3 and m["math/pass_rate"] == pytest.approx(2 / 3)
    assert m["math/fallback_share"] == pytest.approx(0.5)  # one of the two rewarded answers came from the fallback
    assert m["countdown/fallback_share"] == 0 and m["all/n"] == 4
    assert m["all/mean_score"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="4 rewards but 3 lengths"):
        step_metrics(rewards, [1, 2, 3])


def test_length_reward_correlation():
    rewards = [verify(MATH, r"</think> \boxed{42}" if k >= 5 else r"</think> \boxed{1}") for k in range(10)]
    m = step_metrics(rewards, [100 * k for k in range(10)])
    assert m["math/length_reward_corr"] > 0.8
    flat = step_metrics(rewards, [100] * 10)
    assert "math/length_reward_corr" not in flat  # undefined when lengths do not vary


def test_reward_model_vs_rule_disagreement():
    rng = random.Random(0)
    rewards = [verify(MATH, r"</think> \boxed{42}" if k % 2 else r"</think> \boxed{1}") for k in range(40)]
    agree = [r.score + rng.random() * 0.1 for r in rewards]
    inverted = [-s for s in agree]
    noise = [rng.random() for _ in rewards]
    assert step_metrics(rewards, [1] * 40, agree)["math/rm_rule_disagreement"] == 0
    assert step_metrics(rewards, [1] * 40, inverted)["math/rm_rule_disagreement"] == 1
    assert 0.25 < step_metrics(rewards, [1] * 40, noise)["math/rm_rule_disagreement"] < 0.75
    partial = [s if k % 4 else None for k, s in enumerate(agree)]  # rows without an RM score are left out
    assert step_metrics(rewards, [1] * 40, partial)["math/rm_rule_disagreement"] == 0


def test_a_jump_in_fallback_share_is_warned_about_and_noise_is_not():
    rng = random.Random(1)
    monitor = RewardMonitor(window=10, min_history=5)
    for step in range(8):
        _, warnings = monitor.step(*math_step(rng, 30, fallback_share=0.05, pass_rate=0.5))
        assert warnings == [], (step, warnings)
    _, warnings = monitor.step(*math_step(rng, 30, fallback_share=0.9, pass_rate=0.5))
    assert any(w.startswith("math/fallback_share rose") for w in warnings), warnings


def test_jump_rules():
    history = [{"math/pass_rate": 0.5 + 0.01 * (k % 2), "math/n": 10} for k in range(6)]
    assert jump_warnings(history, {"math/pass_rate": 0.52, "math/n": 500}) == []
    assert jump_warnings(history[:3], {"math/pass_rate": 0.95}) == []  # too little history
    (w,) = jump_warnings(history, {"math/pass_rate": 0.95})
    assert w.startswith("math/pass_rate rose to 0.950")
    (w,) = jump_warnings(history, {"math/pass_rate": 0.1})
    assert "fell" in w


def hedging_step(rng, n: int, hedge_share: float, grading: str) -> tuple[list, list]:
    """Real rewards of right answers, some of them hedged (a wrong answer stated before the right
    one: the reference reads the last), under `grading`."""
    row = {**MATH, "grading": grading}
    texts = ["</think> The answer is 41.\nThe answer is 42." if rng.random() < hedge_share else r"</think> \boxed{42}"
             for _ in range(n)]
    return [verify(row, t) for t in texts], [len(t) for t in texts]


@pytest.mark.parametrize("grading", ["reference", "strict"])
def test_hedge_share_is_measured_under_either_grading_and_a_jump_is_warned_about(grading):
    """The share of the rewarded answers (by their domain's own verdict) that state several
    candidates: under reference grading the hedges are paid, under strict grading they score 0
    but are still counted, so a policy learning to hedge shows either way."""
    rng = random.Random(2)
    monitor = RewardMonitor(window=10, min_history=5)
    for step in range(8):
        metrics, warnings = monitor.step(*hedging_step(rng, 40, hedge_share=0.02, grading=grading))
        assert metrics["math/hedge_share"] < 0.15 and warnings == [], (step, warnings)
    metrics, warnings = monitor.step(*hedging_step(rng, 40, hedge_share=0.6, grading=grading))
    assert 0.4 < metrics["math/hedge_share"] == metrics["all/hedge_share"] < 0.8
    assert metrics["math/pass_rate"] == (1.0 if grading == "reference" else 1 - metrics["math/hedge_share"])
    assert any(w.startswith("math/hedge_share rose") for w in warnings), warnings


def test_hedge_share_leaves_out_unrewarded_responses_and_needs_a_rewarded_one():
    wrong_hedge = verify({**MATH, "grading": "strict"}, "</think> The answer is 42.\nThe answer is 41.")
    right = verify({**MATH, "grading": "strict"}, r"</think> \boxed{42}")
    assert step_metrics([wrong_hedge, right], [1, 1])["math/hedge_share"] == 0.0
    assert "math/hedge_share" not in step_metrics([wrong_hedge], [1])
    as_dicts = [r.model_dump() for r in (right, verify({**MATH, "grading": "strict"}, r"</think> \boxed{42 \approx 41}"))]
    assert step_metrics(as_dicts, [1, 1])["math/hedge_share"] == 0.5  # rewards as the pool's JSON
