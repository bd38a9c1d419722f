"""The reward_model stage: Bradley-Terry loss and accuracy on crafted scores, the
preference-data rules (formats, ties, quarantine of bad pairs, held-out split), and a
2-rank DeepSpeed run on tiny synthetic pairs with bad rows mixed in."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from stages.common.rows import Row
from stages.reward_model.bt import PairwiseCounts, bradley_terry_loss, pairwise_accuracy
from stages.reward_model.data import PairStats, encode_pairs, normalise_row, split_heldout, strip_thinking
from tests.stages.conftest import BAD_PAIRS, RLHF_PAIRS


# -- Bradley-Terry ------------------------------------------------------------------------------
def test_bt_loss_matches_closed_form_and_pushes_the_margin():
    c = torch.tensor([2.0, 0.0, -1.0], requires_grad=True)
    r = torch.tensor([0.0, 0.0, 1.0])
    loss = bradley_terry_loss(c, r)
    want = [math.log1p(math.exp(-d)) for d in (2.0, 0.0, -2.0)]  # -log sigmoid(d)
    assert loss.item() == pytest.approx(sum(want) / 3, rel=1e-6)
    assert bradley_terry_loss(c, r, reduction="none").tolist() == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert (c.grad < 0).all()  # descending the loss raises every chosen score
    # the worst-ordered pair gets the largest push: d/dc = -sigmoid(-d) / n
    assert c.grad.tolist() == pytest.approx([-1 / (1 + math.exp(d)) / 3 for d in (2.0, 0.0, -2.0)], rel=1e-5)


def test_bt_tie_label_is_minimal_at_equal_scores():
    half = torch.tensor([0.5])
    losses = {d: bradley_terry_loss(torch.tensor([d]), torch.tensor([0.0]), half).item() for d in (-1.0, 0.0, 1.0)}
    assert losses[0.0] == pytest.approx(math.log(2))
    assert losses[-1.0] == pytest.approx(losses[1.0]) and losses[1.0] > losses[0.0]
    # label 1 reduces to the plain loss
    assert bradley_terry_loss(torch.tensor([0.3]), torch.tensor([0.1]), torch.tensor([1.0])).item() == \
        pytest.approx(bradley_terry_loss(torch.tensor([0.3]), torch.tensor([0.1])).item())
    with pytest.raises(ValueError, match="shape"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


def test_pairwise_accuracy_counts_equal_scores_as_half_and_skips_ties():
    c = torch.tensor([1.0, 0.0, 2.0, -1.0, 5.0])
    r = torch.tensor([0.0, 1.0, 2.0, 0.0, -5.0])
    y = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5])  # the last pair is a tie: not in the accuracy
    counts = PairwiseCounts()
    counts.add(c, r, y)
    m = counts.finalize()
    assert m["accuracy"] == pytest.approx((1 + 0 + 0.5 + 0) / 4)
    assert m["margin"] == pytest.approx((1 - 1 + 0 - 1) / 4)
    assert m["pairs"] == 5
    assert pairwise_accuracy(torch.ones(4), torch.ones(4)) == 0.5  # a constant model is at chance
    # sums add up over micro-batches / ranks
    a, b = PairwiseCounts(), PairwiseCounts()
    a.add(c[:2], r[:2], y[:2])
    b.add(c[2:], r[2:], y[2:])
    merged = PairwiseCounts.from_tensor(a.as_tensor() + b.as_tensor()).finalize()
    assert merged == pytest.approx(m)


# -- preference data ----------------------------------------------------------------------------
class CharTokenizer:
    """One token per character; the init_model chat template."""

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}


def _encode(rows, *, ties="drop", max_len=400, strip=True):
    stats, quarantine = PairStats(), []
    pairs = list(encode_pairs([Row(Path("prefs.jsonl"), i + 1, r) for i, r in enumerate(rows)], CharTokenizer(),
                              strip=strip, max_len=max_len, ties=ties, stats=stats, quarantine=quarantine))
    return pairs, stats, quarantine


def test_formats_normalise_to_prompt_and_two_replies():
    user = {"role": "user", "content": "q"}
    hh = normalise_row({"chosen": [user, {"role": "assistant", "content": "good"}],
                        "rejected": [user, {"role": "assistant", "content": "bad"}]}, "w", 0, True)
    assert hh.prompt == [user] and hh.chosen[0]["content"] == "good" and hh.rejected[0]["content"] == "bad"
    arena = normalise_row({"id": "x", "conversation_a": [user, {"role": "assistant", "content": "A"}],
                           "conversation_b": [user, {"role": "assistant", "content": "B"}],
                           "winner": "tie (bothbad)"}, "w", 0, True)
    assert arena.label == 0.5 and arena.id == "x" and arena.prompt == [user]
    # lmsys 55k: one-hot winner columns, turns as JSON text of lists; earlier turns = prompt
    multi = normalise_row({"prompt": '["q1", "q2"]', "response_a": '["r1", "A2"]', "response_b": '["r1", "B2"]',
                           "winner_model_a": 0, "winner_model_b": 1, "winner_tie": 0}, "w", 0, True)
    assert [m["content"] for m in multi.prompt] == ["q1", "r1", "q2"] and multi.label == 0.0
    assert multi.chosen == [{"role": "assistant", "content": "A2"}]
    assert strip_thinking("<think>work</think>\nThe answer") == "The answer"
    assert strip_thinking("<think>never closed") == "" and strip_thinking("plain") == "plain"


def test_bad_pairs_are_quarantined_with_reasons_and_ties_follow_the_setting():
    good = {"prompt": "What is 2 + 2?", "chosen": "<think>2+2</think>4", "rejected": "<think>hm</think>5"}
    rows = [
        good,
        {"prompt": "p", "chosen": "same answer", "rejected": "same  answer "},          # identical
        {"prompt": "p", "chosen": "x"},                                                 # no rejected
        {"chosen": "x", "rejected": "y"},                                               # no prompt
        {"prompt": "p", "chosen": 3, "rejected": "y"},                                  # bad type
        {"prompt": "p", "response_a": "a", "response_b": "b", "winner": "model_c"},     # bad winner
        {"prompt": "p", "response_a": "a", "response_b": "b", "winner": "model_b"},     # b preferred
        {"prompt": "p", "response_a": "a", "response_b": "b", "winner": "tie"},         # tie
        {"prompt": "p", "chosen": "<think>long</think>42", "rejected": "<think>short</think>42"},
        {"prompt": "p", "chosen": [{"role": "user", "content": "hi"}], "rejected": "y"},  # no reply
        {"prompt": "p" * 500, "chosen": "x", "rejected": "y"},                          # too long
        {"prompt": "p", "chosen": "z" * 500 + "1", "rejected": "z" * 500 + "2"},        # differ past the cut
        {"prompt": None, "chosen": "a", "rejected": "b", "winner": None},                # null = absent
        "not an object",
    ]
    pairs, stats, quarantine = _encode(rows)
    reasons = {q["row"]: q["reason"] for q in quarantine}
    assert reasons == {2: "identical", 3: "missing_field", 4: "missing_field", 5: "bad_type", 6: "bad_winner",
                       9: "identical", 10: "no_response", 11: "too_long", 12: "identical_after_truncation",
                       13: "missing_field", 14: "bad_type"}
    assert all(q["file"] == "prefs.jsonl" and q["detail"] for q in quarantine)
    assert quarantine[-2]["data"]["chosen"] == "a"  # the row itself is kept for the user to fix
    assert stats.quarantined["identical"] == 2 and sum(stats.quarantined.values()) == 11
    assert stats.ties == 1 and stats.ties_dropped == 1 and stats.pairs == 2
    swapped = [p for p, _ in pairs if p.where == "prefs.jsonl:7"][0]
    assert swapped.chosen[0]["content"] == "b" and swapped.label == 1.0
    # thinking is stripped before tokenising (the model scores answers)
    first = pairs[0][1]
    text = "".join(map(chr, first.chosen))
    assert "<think>" not in text and text.endswith("4<|im_end|>\n")
    # ties kept with label 1/2
    pairs, stats, _ = _encode(rows, ties="half")
    assert stats.ties == 1 and stats.ties_dropped == 0 and [e.label for _, e in pairs] == [1.0, 1.0, 0.5]
    # without strip_thinking the thinking-only difference is a real difference
    _, _, quarantine = _encode(rows, strip=False)
    assert 9 not in {q["row"] for q in quarantine}


def test_heldout_split_is_by_content_and_never_empty():
    rows = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(200)]
    pairs, _, _ = _encode(rows + rows[:20])  # 20 duplicated pairs
    train, held = split_heldout(pairs, 0.1, seed=0)
    assert len(train) + len(held) == 220 and 5 < len(held) < 45
    held_keys = {tuple(e.chosen) for e in held}
    assert not held_keys & {tuple(e.chosen) for e in train}  # a duplicate never sits on both sides
    assert split_heldout(pairs, 0.1, seed=0)[1] == held  # deterministic
    train2, held2 = split_heldout(pairs[:3], 1e-9, seed=0)
    assert len(held2) == 1 and len(train2) == 2


# -- the stage ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reward_model_stage_two_ranks(tiny_rm, rlhf_data, stage_env):
    """Trained on the synthetic pairs + bad rows: quarantine, held-out accuracy in MLflow and the
    manifest, a loadable HF sequence-classification model that the scorer reads."""
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForSequenceClassification

    from data_curation.urls import local_path
    from stages.common.artifact_inputs import verify_artifact
    from stages.reward_model.scoring import RewardScorer

    run = tiny_rm
    s = run.summary
    assert s["world_size"] == 2 and s["steps"] == 8
    assert s["data"]["rows"] == RLHF_PAIRS + len(BAD_PAIRS) and s["data"]["quarantined"] == 3
    assert s["data"]["quarantine_reasons"] == {"identical": 1, "missing_field": 1, "bad_winner": 1}
    assert s["train_pairs"] + s["eval_pairs"] == RLHF_PAIRS and s["eval_pairs"] >= 4
    # it learned: held-out loss below the untrained model's and below chance
    assert s["eval_loss"] < s["eval_loss_initial"] and s["eval_loss"] < math.log(2)
    out = Path(local_path(run.url))
    verify_artifact(run.url)
    quarantined = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert {q["id"]: q["reason"] for q in quarantined} == {
        "bad-identical": "identical", "bad-missing": "missing_field", "bad-winner": "bad_winner"}
    assert all(q["file"].endswith("prefs_with_bad.jsonl") and q["row"] > RLHF_PAIRS for q in quarantined)
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    # the scorer renders pairs as training did: it reproduces the order on the training data
    rows = [json.loads(line) for line in rlhf_data.prefs.read_text().splitlines()]
    scorer = RewardScorer(out, batch_size=8, trust_remote_code=False)
    chosen = scorer.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = scorer.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(rows) > 0.6
    assert scorer.score([rows[0]["prompt"]], [rows[0]["chosen"]]) == pytest.approx([chosen[0]], abs=1e-5)
    # held-out accuracy in MLflow, per evaluation
    client = MlflowClient(stage_env["tracking_uri"])
    history = client.get_metric_history(run.run_id, "eval/accuracy")
    assert [m.step for m in history] == [0, 4, 8]
    assert history[-1].value == pytest.approx(s["eval_accuracy"])
