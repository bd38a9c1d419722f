import json
import random
import re

import pytest

from data_curation.benchmarks import benchmarks_dir
from tests.conftest import NO_BENCHMARKS
from verifiers import verify
from verifiers.extract import ExtractionOptions, NoAnswer, extract_answer, final_text, find_boxed
from verifiers.math_answer import math_equal
from verifiers.math_gen import generate_arithmetic

pytestmark = pytest.mark.timeout(60)


def m(answer, response, **row):
    return verify({"domain": "math", "prompt": "", "reference": {"answer": answer}, **row}, response)


def test_extraction_basics():
    assert find_boxed(r"x \boxed{\frac{1}{\sqrt{2}}} y \boxed{ {a}{b} }") == [r"\frac{1}{\sqrt{2}}", "{a}{b}"]
    assert final_text("<think>a</think><think>b</think> final") == "final"
    with pytest.raises(NoAnswer):
        final_text("<think>done</think> x <think> again")
    assert extract_answer("so the final answer is: 42.")[0] == "42"
    assert extract_answer("many steps 3 then 17 apples")[0] == "17"
    opts = ExtractionOptions.from_dict({"strategies": ["boxed"]})
    with pytest.raises(NoAnswer):
        extract_answer("the answer is 3", opts)


@pytest.mark.parametrize("gold,pred", [
    ("12", "12"), ("12", "12.0"), ("12", r"\boxed{12}"), ("12", "$12$"), ("1200", "1,200"), ("1200", "1.2e3"),
    ("1200", r"1.2 \times 10^{3}"), ("0.5", r"\frac{1}{2}"), ("0.5", "1/2"), ("\\frac{1}{2}", r"\dfrac12"),
    ("25\\%", "25"), ("0.25", "25\\%"), ("18", "\\$18"), ("18", r"18 \text{ dollars}"), ("27", "27 miles"),
    (r"3\sqrt{2}", r"\sqrt{18}"), (r"\frac{\pi}{2}", r"\pi/2"), ("x^2+2x+1", "(x+1)^2"), (r"[-2,7]", "[-2, 7]"),
    (r"\{1,2\}", r"\{2,1\}"), ("(1,2)", "(1, 2)"), ("x=3", "3"), ("C", "(C)"), (r"\text{(C)}", "C"),
    ("Evelyn", r"\text{Evelyn}"), ("2.5", "5/2"), ("-3", "-3.0"), ("10^{-3}", "0.001"),
])
def test_equivalent_forms(gold, pred):
    assert math_equal(gold, pred)[0], (gold, pred)


@pytest.mark.parametrize("gold,pred", [
    ("12", "13"), ("12", "12.5"), ("0.5", r"\frac{1}{3}"), ("(1,2)", "(2,1)"), ("[-2,7]", "(-2,7)"),
    ("x^2+2x+1", "(x-1)^2"), ("C", "D"), ("C", "(C) or (D)"), ("Evelyn", "Evlyen"), ("1200", "12,00"),
    ("27", "27 or 28"), ("27", "27, 28"), ("25", "0.25"),
])
def test_non_equivalent(gold, pred):
    assert not math_equal(gold, pred)[0], (gold, pred)


def test_gamed_responses_score_zero():
    # boxed answer only inside the thinking section
    assert m("27", r"<think>it is \boxed{27}</think> I am not sure.").score == 0
    # answer stuffing: many different boxed candidates
    r = m("27", "</think> " + " ".join(rf"\boxed{{{i}}}" for i in range(20, 40)))
    assert r.score == 0 and "stuffing" in r.reason
    assert m("27", r"</think> \boxed{27 \text{ or } 28}").score == 0
    assert m("27", r"</think> \boxed{20, 21, 22, 23, 24, 25, 26, 27, 28}").score == 0
    # unclosed think
    assert m("27", r"<think> \boxed{27}").score == 0
    # the same boxed answer repeated is fine
    assert m("27", r"</think> \boxed{27} so \boxed{27}").score == 1


def test_surface_forms_through_verify():
    for resp in [r"<think>x</think> The answer is $\boxed{\dfrac{3}{4}}$.", "</think> **Final answer:** 0.75",
                 "</think> 3/4", "</think> We get 75%.", r"</think> $x = \frac{3}{4}$"]:
        r = m("\\frac{3}{4}", resp)
        assert r.score == 1, (resp, r)


def test_math_timeout_is_bounded():
    r = verify({"domain": "math", "reference": {"answer": "x"}}, r"</think> \boxed{" + "(x+1)^{99}" * 30 + "}", timeout_s=1.0)
    assert r.elapsed_s < 3


def test_arithmetic_generator():
    rows = generate_arithmetic(20, seed=3)
    assert rows == generate_arithmetic(20, seed=3) and rows != generate_arithmetic(20, seed=4)
    for row in rows:
        a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)\?", row["prompt"]).groups()
        val = eval(f"{a}{op}{b}")  # noqa: S307 - test of our own generated text
        assert row["reference"]["answer"] == str(val) and row["domain"] == "math"
        assert verify(row, f"<think>easy</think> {val}").score == 1
        assert verify(row, f"<think>easy</think> {val + 1}").score == 0


# ---- the public benchmarks (RING_BENCHMARKS_DIR: tests/conftest.py): each reference answer
# rewritten must verify, perturbed must not
def _answers(name: str) -> list[str]:
    out = []
    for line in (benchmarks_dir() / name).read_text().splitlines():
        row = json.loads(line)
        if name == "gsm8k.jsonl":
            out.append(row["answer"].split("####")[-1].strip())
        elif name == "minerva_math.jsonl":
            from verifiers.extract import find_boxed
            out.append(find_boxed(row["solution"])[-1])
        else:
            a = row["answer"]
            out.append(str(int(a)) if isinstance(a, float) and a.is_integer() else str(a))
    return out


def _rewrite(ans: str, rng: random.Random) -> str:
    s = ans.strip()
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+|-?\d+", s):
        v = int(s.replace(",", ""))
        forms = [f"{v:,}", f"{v}.0", f"{v}.00", rf"\boxed{{{v}}}", f"{v} units"]
        if v and v % 10 == 0:
            forms.append(rf"{v // 10} \times 10^{{1}}")
        return rng.choice(forms)
    t = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    t = re.sub(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", r"\\dfrac{\1}{\2}", t)
    t = t.replace(", ", ",") if ", " in t else t.replace(",", ", ")
    return t


def _perturb(ans: str) -> str | None:
    m_ = re.search(r"\d", ans)
    if m_ is None:
        return None
    d = int(m_.group())
    return ans[: m_.start()] + str((d + 1) % 10 if d != 9 else 7) + ans[m_.end():]


@pytest.mark.skipif(benchmarks_dir() is None, reason=NO_BENCHMARKS)
@pytest.mark.parametrize("name,limit", [("aime24.jsonl", None), ("aime25.jsonl", None), ("amc23.jsonl", None),
                                        ("gsm8k.jsonl", 150), ("math500.jsonl", 300), ("minerva_math.jsonl", 80)])
def test_benchmark_answers(name, limit):
    failures, n = benchmark_failures(name, limit)
    assert len(failures) <= 0.02 * 2 * n, failures[:10]


def benchmark_failures(name, limit):
    rng = random.Random(0)
    answers = _answers(name)[:limit]
    failures = []
    for gold in answers:
        rewritten = _rewrite(gold, rng)
        ok = verify({"domain": "math", "reference": {"answer": gold}}, f"<think>...</think> The answer is $\\boxed{{{rewritten}}}$.")
        if ok.score != 1:
            failures.append(("rewritten", gold, rewritten, ok.reason))
        bad = _perturb(gold)
        if bad is not None:
            r = verify({"domain": "math", "reference": {"answer": gold}}, f"</think> \\boxed{{{bad}}}")
            if r.score != 0:
                failures.append(("perturbed", gold, bad, r.reason))
    return failures, len(answers)


# ---- generated equivalent forms and near misses, by category (verifiers.math_cases) --------
def test_generated_near_misses_rejected_and_equivalent_forms_accepted():
    from verifiers.math_cases import generate_cases, score_cases

    table = score_cases(generate_cases(n_per_category=4, seed=13))
    for kind in ("equivalent", "near_miss"):
        row = table[f"all/{kind}"]
        assert row["n"] >= 150 and row["rate"] >= 0.99, (kind, row["failures"][:10])


@pytest.mark.parametrize("gold,pred,ok", [
    # integers are exact: a decimal within 1e-6 relative is still another number
    ("11111111100", "11111111101.0", False), ("1000000", "1000001.0", False), ("1000000", "1.000000e6", True),
    # non-integer golds: tolerance, configurable per task
    (r"\frac{1}{3}", "0.3333333", True), (r"\frac{1}{3}", "0.333", False),
    # units only from the known list; a variable or a second candidate is not a unit
    ("2", "2i", False), ("3", "3x", False), (r"\frac12", r"\frac12 x", False), ("5", "5 or 6", False),
    ("5", "5 m", True), ("5", "5 \\text{ cm}", True), ("5 cm", "5 m", False), ("5", "5 eggs", False),
    # currency
    ("32348", "$32,348", True), ("32348", r"\$32,348", True), ("32348", r"32{,}348 \text{ dollars}", True),
    # intervals vs inequalities, both ways
    ("(3, \\infty)", "x > 3", True), ("x>3", "(3,\\infty)", True), ("[2, 5)", "2 \\le x < 5", True),
    ("[2, 5)", "2 < x < 5", False),
])
def test_number_rules(gold, pred, ok):
    assert math_equal(gold, pred)[0] is ok, (gold, pred)


def test_tolerance_and_units_are_per_task():
    row = {"domain": "math", "reference": {"answer": "3.14159", "rel_tol": 1e-3}}
    assert verify(row, r"</think> \boxed{3.1416}").score == 1
    assert verify({**row, "reference": {"answer": "3.14159"}}, r"</think> \boxed{3.1416}").score == 0
    assert verify({"domain": "math", "reference": {"answer": "12", "units": ["eggs"]}}, "</think> 12 eggs").score == 1
    bad = verify({"domain": "math", "reference": {"answer": "1.5", "rel_tol": "lots"}}, "</think> 1.5")
    assert bad.score == 0 and "rel_tol" in bad.reason and bad.source == "verifier_error"


def test_letters_only_for_lettered_options():
    prompt = "Which is prime?\n(A) 4\n(B) 6\n(C) 7\n(D) 9"
    row = {"domain": "math", "prompt": prompt, "reference": {"answer": "C"}}
    for good in ["C", "(C)", r"\text{(C)}", "C) 7", "7"]:
        assert verify(row, rf"</think> \boxed{{{good}}}").score == 1, good
    for bad in ["C or D", "(C) (D)", "C D", "C) 9", "9"]:
        assert verify(row, rf"</think> \boxed{{{bad}}}").score == 0, bad
    # a numeric gold is never matched by an option letter
    assert verify({**row, "reference": {"answer": "7"}}, r"</think> \boxed{C}").score == 0


def test_sources_say_which_path_found_the_answer():
    row = {"domain": "math", "reference": {"answer": "42"}}
    assert verify(row, r"</think> so \boxed{42}").source == "boxed"
    assert verify(row, "</think> The answer is 42.").source == "answer_is"
    assert verify(row, "</think> 42").source == "bare"
    assert verify(row, "</think> I computed it as 42 in the end").source == "last_number"
    # an answer marker switches the fallback off: the last number does not rescue it
    r = verify(row, r"</think> \boxed{x} and x is 42")
    assert r.score == 0 and r.source == "boxed"
    r = verify(row, "</think> The answer is unclear. 42")
    assert r.score == 0 and r.source == "answer_is"
    # a list of numbers is stuffing, not a fallback answer
    r = verify(row, "</think> " + " ".join(str(i) for i in range(1, 43)))
    assert r.score == 0 and r.source == "no_answer" and "numbers" in r.reason
    # the same answer boxed twice in two notations is one answer
    assert verify({"domain": "math", "reference": {"answer": "1/2"}}, r"</think> \boxed{1/2} = \boxed{0.5}").score == 1
