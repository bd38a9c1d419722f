"""Our GSM8K scoring (the math verifier with a GSM8K set's extraction) against lm-eval's GSM8K
metric (the `gsm8k` task's strict-match and flexible-extract filters, exact_match with its
regexes) on crafted responses in many formats, right and wrong. Every row where they differ
must be one of the explained, expected differences below; the rest must agree."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

from stages.eval.gsm8k_agreement import agreement, main  # noqa: E402

GOLD = "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
GOLD_BIG = "It costs 1000 + 234 = <<1000+234=1234>>1234.\n#### 1234"

# (id, response, gold): right and wrong answers in the formats models write
CASES = [
    ("hash", "9 * 2 = 18\n#### 18", GOLD),
    ("hash_wrong", "9 * 2 = 19\n#### 19", GOLD),
    ("hash_worked", "Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18", GOLD),
    ("hash_worked_wrong", "Janet sells 16 - 3 = 13 eggs.\nShe makes 13 * 2 = $26.\n#### 26", GOLD),
    ("hash_dollar", "She makes $18 a day.\n#### $18", GOLD),
    ("hash_comma", "The total is 1,234.\n#### 1,234", GOLD_BIG),
    ("hash_negative_wrong", "#### -18", GOLD),
    ("boxed", "9 * 2 = 18, so the answer is \\boxed{18}.", GOLD),
    ("boxed_wrong", "So she makes \\boxed{16}.", GOLD),
    ("boxed_dollar", "She makes \\boxed{\\$18} per day.", GOLD),
    ("answer_is", "The answer is 18.", GOLD),
    ("answer_is_wrong", "The answer is 17.", GOLD),
    ("answer_is_dollar", "The answer is $18.", GOLD),
    ("answer_is_comma", "The final answer is 1,234.", GOLD_BIG),
    ("final_answer_colon", "Final answer: 18", GOLD),
    ("bare", "18", GOLD),
    ("bare_wrong", "81", GOLD),
    ("bare_dollar", "$18", GOLD),
    ("units", "She makes 18 dollars.", GOLD),
    ("units_wrong", "She makes 20 dollars.", GOLD),
    ("trailing_text", "18 dollars is what she makes every day. Hope this helps!", GOLD),
    ("comma_number", "It costs 1,234 in total.", GOLD_BIG),
    ("two_numbers", "She sells 9 eggs and makes 18.", GOLD),
    ("two_numbers_wrong", "She makes 18 from eggs, so 9.", GOLD),
    ("think_then_answer", "<think>16 - 3 - 4 = 9, 9 * 2 = 18</think>\nThe answer is 18.", GOLD),
    ("empty", "", GOLD),
    ("no_number", "I don't know.", GOLD),
    ("decimal_wrong", "The answer is 18.5.", GOLD),
    # formats where the two scorings differ by design (explained in EXPECTED)
    ("many_numbers", "She has 16 - 3 - 4 = 9 eggs left and sells them at $2, so 9 * 2 = 18.", GOLD),
    ("trailing_zeros", "The answer is 18.00.", GOLD),
    ("answer_then_more_numbers", "The answer is 18. She ate 3 and baked 4.", GOLD),
]

# row -> why ours and lm-eval's flexible-extract differ (lm-eval's right / ours' right)
EXPECTED = {
    "many_numbers": "ours refuses the last-number fallback over more than 4 numbers without an answer marker "
                    "(a list of candidates is stuffing); flexible-extract takes the last number anyway",
    "trailing_zeros": "ours compares numbers (18.00 = 18); lm-eval compares strings after removing ',', '$' "
                      "and a final '.', so '18.00' != '18'",
}
# rows writing "#### N" where strict-match differs from ours
STRICT_EXPECTED = {"hash_dollar": "strict-match's regex '#### (-?[0-9.,]+)' does not read '#### $18'; ours "
                                  "removes the currency sign"}


def _rows():
    return [{"id": i, "response": r, "answer": g} for i, r, g in CASES]


def test_our_gsm8k_scoring_agrees_with_lm_evals_metric_or_the_difference_is_explained():
    report = agreement(_rows())
    flexible = {d["id"]: d for d in report["disagreements"]["flexible-extract"]}
    assert set(flexible) == set(EXPECTED), {k: (v["ours"], v["lm_eval"], v["lm_eval_extracted"])
                                            for k, v in flexible.items()}
    agreed = len(CASES) - len(EXPECTED)
    assert report["agreement"]["flexible-extract"] == pytest.approx(agreed / len(CASES))
    # where neither format is one of the explained ones, agreement is complete (>= 99%)
    rest = [r for r in _rows() if r["id"] not in EXPECTED]
    assert agreement(rest)["agreement"]["flexible-extract"] == 1.0
    # strict-match reads only "#### N": on the rows that write it, it agrees with ours everywhere
    hash_rows = [r for r in _rows() if "####" in r["response"] and r["id"] not in STRICT_EXPECTED]
    assert agreement(hash_rows)["agreement"]["strict-match"] == 1.0
    strict = {d["id"]: d for d in report["disagreements"]["strict-match"]}
    assert all(d["lm_eval_extracted"] == "[invalid]" and ("####" not in d["response"] or d["id"] in STRICT_EXPECTED)
               for d in strict.values())
    # the scores are right, not merely equal: the wrong answers score 0 in both
    right = {i for i, _, _ in CASES if not i.endswith("_wrong") and i not in ("empty", "no_number")}
    wrong_ids = {i for i, _, _ in CASES} - right
    assert not any(d["ours"] for d in report["disagreements"]["flexible-extract"] if d["id"] in wrong_ids)


def test_cli_reads_eval_responses_and_a_gold_file(tmp_path, capsys):
    gold = tmp_path / "gsm8k.jsonl"
    gold.write_text("".join(json.dumps({"question": "q", "answer": g, "idx": i}) + "\n"
                            for i, g in enumerate([GOLD, GOLD_BIG])))
    gens = tmp_path / "responses.jsonl"
    gens.write_text("".join(json.dumps(r) + "\n" for r in [
        {"set": "gsm8k", "id": 0, "response": "#### 18"}, {"set": "gsm8k", "id": 1, "response": "The answer is 99."},
        {"set": "other", "id": 0, "response": "x"}]))
    out = tmp_path / "report.json"
    assert main([str(gens), "--gold", str(gold), "--set", "gsm8k", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == 2 and report["ours_accuracy"] == 0.5
    assert report["lm_eval_accuracy"] == {"strict-match": 0.5, "flexible-extract": 0.5}
    assert "agreement with ours 1.0000" in capsys.readouterr().out
    gens.write_text('{"set": "gsm8k", "id": 7, "response": "x"}\n{"broken\n')
    assert main([str(gens), "--gold", str(gold)]) == 2
    assert f"{gens}:1: no 'answer' field and id 7 is not in {gold}" in capsys.readouterr().err


def _eval_stage_dir(tmp_path, extraction):
    """A published eval stage as the pipeline writes it: responses.jsonl (two models, greedy) and
    manifest.json whose config holds the set's extraction options."""
    stage = tmp_path / "eval_rl-0123456789ab"
    stage.mkdir()
    # "#### 18" after many numbers: GSM8K's hashes strategy reads it; the verifier's defaults refuse
    # a last number among more than four without a marker
    many = "9 eggs, 2 each, 3 days, 5 cats, 7 dogs: #### 18"
    rows = [{"model": m, "set": "gsm8k", "decoding": "greedy", "id": i, "response": r}
            for m in ("sft", "rl") for i, r in enumerate(["#### 18", many])]
    rows.append({"model": "rl", "set": "heldout", "decoding": "greedy", "id": 0, "response": "x"})
    (stage / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gsm8k = {"hub": "openai/gsm8k", "config": "main", "split": "test", "question_field": "question", "answer_field": "answer",
             "answer_extractor": "gsm8k", **({"extraction": extraction} if extraction is not None else {})}
    (stage / "manifest.json").write_text(json.dumps({"kind": "eval", "config": {"sets": {"gsm8k": gsm8k}},
                                                     "files": [{"path": "responses.jsonl"}]}))
    (stage / "_SUCCESS").write_text("")
    gold = tmp_path / "gsm8k.jsonl"
    gold.write_text("".join(json.dumps({"question": "q", "answer": GOLD, "idx": i}) + "\n" for i in range(2)))
    return stage, gold


@pytest.mark.parametrize("extraction, ours", [(None, 0.5), ({"strategies": ["hashes", "last_number"]}, 1.0)])
def test_an_eval_stage_dir_is_scored_with_its_sets_own_extraction(tmp_path, extraction, ours):
    """'ours' is the score the eval reported: the set's extraction from the stage's manifest, the
    verifier's defaults where the recipe set none (not GSM8K_EXTRACTION, which reads both rows)."""
    stage, gold = _eval_stage_dir(tmp_path, extraction)
    out = tmp_path / "report.json"
    assert main([str(stage), "--set", "gsm8k", "--gold", str(gold), "--model", "rl", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"] == 2 and report["ours_accuracy"] == ours
    assert report["extraction"] == (extraction or {})
    # an explicit --extraction still wins
    assert main([str(stage), "--set", "gsm8k", "--gold", str(gold), "--model", "rl", "--out", str(out),
                 "--extraction", '{"strategies": ["hashes"]}']) == 0
    assert json.loads(out.read_text())["ours_accuracy"] == 1.0


def test_rows_of_several_models_or_a_stage_dir_without_its_set_are_refused(tmp_path, capsys):
    stage, gold = _eval_stage_dir(tmp_path, None)
    assert main([str(stage), "--set", "gsm8k", "--gold", str(gold)]) == 2
    err = capsys.readouterr().err
    assert "2 (model, decoding) pairs" in err and "('rl', 'greedy')" in err and "--model" in err
    assert main([str(stage), "--gold", str(gold), "--model", "rl"]) == 2
    assert "needs --set" in capsys.readouterr().err
    assert main([str(stage), "--set", "math500", "--gold", str(gold), "--model", "rl"]) == 2
    assert "no set 'math500' (its sets: ['gsm8k'])" in capsys.readouterr().err
    assert main([str(stage), "--set", "gsm8k", "--gold", str(gold), "--model", "base"]) == 2
    assert "no rows of set 'gsm8k', model 'base'" in capsys.readouterr().err
    (stage / "_SUCCESS").unlink()  # a stage that has not finished: its manifest is not read as final
    assert main([str(stage), "--set", "gsm8k", "--gold", str(gold), "--model", "rl"]) == 2
    assert "not a published eval stage" in capsys.readouterr().err
