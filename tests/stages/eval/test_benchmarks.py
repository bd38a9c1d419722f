"""The public benchmark sets as they are, named by hub id and read from their local copies under
RING_BENCHMARKS_DIR (tests/conftest.py: skipped where none is given), as eval rows through a set's field mapping:
every row of every file yields its gold answer, the verifier accepts the gold in a box and
refuses a wrong one, and bad rows or mappings are named with file, line and field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.plan import result_config
from stages.common.contract import StageError
from stages.eval.benchmarks import GSM8K_EXTRACTION, benchmark_rows, gsm8k_gold
from stages.eval.config import BenchmarkSet, EvalConfig, EvalSet, LmEvalSet
from verifiers import verify

GSM8K_PROMPT = "{question}\nPut your final answer after '####'."
# file -> (mapping, rows, the first row's gold)
SETS = {
    "gsm8k": ({"question_field": "question", "answer_field": "answer", "answer_extractor": "gsm8k",
               "id_field": "idx", "prompt_template": GSM8K_PROMPT, "extraction": GSM8K_EXTRACTION}, 1319, "18"),
    "math500": ({"question_field": "problem", "answer_field": "answer", "id_field": "unique_id"}, 500,
                "\\left( 3, \\frac{\\pi}{2} \\right)"),
    "minerva_math": ({"question_field": "problem", "answer_field": "solution", "answer_extractor": "boxed",
                      "id_field": "idx"}, 272, "1.6"),
    "amc23": ({"question_field": "problem", "answer_field": "answer", "id_field": "id"}, 40, 27.0),
    "aime24": ({"question_field": "problem", "answer_field": "answer", "id_field": "id"}, 30, "204"),
    "aime25": ({"question_field": "problem", "answer_field": "answer"}, 30, "70"),
}


def _fetch(p: str) -> Path:
    return Path(p)


# the hub ids of recipes/benchmarks.yaml; the copies are found by set name under RING_BENCHMARKS_DIR
HUB = {"gsm8k": {"hub": "openai/gsm8k", "config": "main", "split": "test"},
       "math500": {"hub": "HuggingFaceH4/MATH-500", "split": "test"},
       "minerva_math": {"hub": "math-ai/minervamath", "split": "test"},
       "amc23": {"hub": "math-ai/amc23", "split": "test"},
       "aime24": {"hub": "HuggingFaceH4/aime_2024", "split": "train"},
       "aime25": {"hub": "math-ai/aime25", "split": "test"}}


def _set(name: str, **extra) -> BenchmarkSet:
    mapping, _, _ = SETS[name]
    return BenchmarkSet(**HUB[name], **{**mapping, **extra})


@pytest.mark.parametrize("name", sorted(SETS))
def test_every_public_benchmark_reads_as_it_is(name, benchmark_sets):
    _, n, first_gold = SETS[name]
    rows = benchmark_rows(_fetch, name, _set(name))
    assert len(rows) == n and len({str(r["id"]) for r in rows}) == n
    assert rows[0]["reference"] == {"answer": first_gold} and all(r["domain"] == "math" for r in rows)
    assert rows[0]["messages"] == [{"role": "user", "content": rows[0]["prompt"]}]
    # the gold in a box is right and a changed gold is wrong (first rows: math-verify is slow)
    for row in rows[:8]:
        gold = row["reference"]["answer"]
        gold = str(int(gold)) if isinstance(gold, float) and gold.is_integer() else str(gold)
        assert verify(row, f"So the answer is \\boxed{{{gold}}}.").score == 1.0, (row["id"], gold)
        assert verify(row, f"So the answer is \\boxed{{{gold} + 1}}.").score == 0.0, (row["id"], gold)


def test_gsm8k_set_reads_its_own_answer_format(benchmark_sets):
    rows = benchmark_rows(_fetch, "gsm8k", _set("gsm8k", limit=3))
    assert len(rows) == 3 and rows[0]["id"] == 0
    assert rows[0]["prompt"].startswith("Janet") and rows[0]["prompt"].endswith("after '####'.")
    row = rows[0]
    worked = "Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18 every day.\n#### 18"
    assert verify(row, worked).score == 1.0 and verify(row, worked).source == "hashes"
    assert verify(row, worked.replace("#### 18", "#### 19")).score == 0.0
    assert verify(row, "The answer is \\boxed{18}.").score == 1.0  # the other markers still read
    # the gold is the answer line of the worked solution, thousands separators removed
    assert gsm8k_gold("a\n#### 1,000") == "1000" and gsm8k_gold("#### -3") == "-3"
    assert gsm8k_gold("no marker 18") is None and gsm8k_gold("#### ") is None and gsm8k_gold(18) is None


def test_bad_rows_and_mappings_name_file_line_and_field(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text(json.dumps({"question": "q1", "answer": "x\n#### 4"}) + "\n"
                 + json.dumps({"question": "q2", "answer": "no final line"}) + "\n")
    spec = BenchmarkSet(path=str(f), question_field="question", answer_field="answer", answer_extractor="gsm8k")
    with pytest.raises(StageError, match=rf"{f}:2: no gold answer in field 'answer' with answer_extractor 'gsm8k'"):
        benchmark_rows(_fetch, "b", spec)
    spec = BenchmarkSet(path=str(f), question_field="problem", answer_field="answer")
    with pytest.raises(StageError, match=rf"{f}:1: field 'problem' \(question_field\).*fields: \['answer', 'question'\]"):
        benchmark_rows(_fetch, "b", spec)
    spec = BenchmarkSet(path=str(f), question_field="question", answer_field="solution")
    with pytest.raises(StageError, match=rf"{f}:1: field 'solution' \(answer_field\) is missing"):
        benchmark_rows(_fetch, "b", spec)
    f.write_text('{"question": "q", "answer": null}\n')
    spec = BenchmarkSet(path=str(f), question_field="question", answer_field="answer")
    with pytest.raises(StageError, match=rf"{f}:1: no gold answer"):
        benchmark_rows(_fetch, "b", spec)


@pytest.mark.parametrize("bad,needle", [
    ({"answer_extractor": "regex"}, "answer_extractor 'regex': known ones are"),
    ({"prompt_template": "Solve it."}, "must contain {question}"),
    ({"extraction": {"strategies": ["sixth_sense"]}}, "unknown"),
])
def test_benchmark_set_config_errors(bad, needle):
    sets = {"g": {"path": "g.jsonl", "question_field": "question", "answer_field": "answer", **bad}}
    with pytest.raises(ValidationError, match=needle):
        EvalConfig.model_validate({"kind": "eval", "models": {"m": "/m"}, "sets": sets})


def test_set_kinds_are_told_apart_and_old_sets_hash_as_before():
    cfg = EvalConfig.model_validate({"kind": "eval", "models": {"m": "/m"}, "sets": {
        "rl": "a.jsonl", "limited": {"path": "a.jsonl", "limit": 5},
        "bench": {"path": "g.jsonl", "question_field": "question", "answer_field": "answer"},
        "harness": {"lm_eval": "task.yaml", "data": "d.jsonl"}}})
    kinds = {k: type(v) for k, v in cfg.sets.items()}
    assert kinds == {"rl": EvalSet, "limited": EvalSet, "bench": BenchmarkSet, "harness": LmEvalSet}
    # an RL set dumps exactly the keys it had: existing eval stages keep their hashes
    assert result_config(cfg)["sets"]["limited"] == {"path": "a.jsonl", "limit": 5}
    assert result_config(cfg)["sets"]["rl"] == {"path": "a.jsonl", "limit": None}
