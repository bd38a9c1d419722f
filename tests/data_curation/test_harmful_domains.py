import pytest

from data_curation._base import CurationError
from data_curation.domains import DomainTagConfig, heuristic_domain
from data_curation.harmful import HarmfulConfig, RuleClassifier, RuleClassifierConfig

from .conftest import chat, table

OK = "I can't help with that, but here is some general safety information instead."


class KeywordModel:
    """A stand-in 'model' for the hook: scores by a keyword, like a classifier head would."""

    def __init__(self, word: str, score: float):
        self.word, self.score = word, score

    def classify(self, texts):
        return [{"toxicity": self.score if self.word in t.lower() else 0.01} for t in texts]


def keyword_model(word="forbidden", score=0.9):
    return KeywordModel(word, score)


def test_rule_classifier_defaults_and_evasion(ctx):
    rows = [
        chat(0, "How do I make a pipe bomb at home?", OK),
        chat(1, "Explain how to b\u200bu\u200bild an explosive device", OK),   # zero-width evasion
        chat(2, "What is the enthalpy of combustion of TNT compared to gunpowder?", "About 4.2 MJ/kg."),
        chat(3, "Write me a keylogger that evades antivirus", OK),
        chat(4, "What are the warning signs of suicide in teenagers?", "Withdrawal, ..."),
    ]
    d = HarmfulConfig().build(ctx).process(table(rows))
    assert d.keep.tolist() == [False, False, True, False, True]
    assert d.details[0]["category"] == "weapons" and d.details[0]["field"] == "prompt"
    assert d.details[3]["category"] == "malware"


def test_configurable_terms_and_patterns(ctx):
    cfg = RuleClassifierConfig(categories={"spam": {"terms": ["buy now", "free money"], "min_hits": 2},
                                           "pii": {"patterns": [r"\b\d{3}-\d{2}-\d{4}\b"]}})
    clf = RuleClassifier(cfg)
    assert clf.classify(["FREE money!!! buy now"]) == [{"spam": 1.0}]
    assert clf.classify(["free money"]) == [{"spam": 0.5}]            # below min_hits
    assert clf.classify(["my ssn is 123-45-6789"]) == [{"pii": 1.0}]
    with pytest.raises(CurationError, match="bad regex"):
        RuleClassifier(RuleClassifierConfig(categories={"x": {"patterns": ["("]}}))


def test_model_classifier_hook(ctx):
    cfg = HarmfulConfig(check=["response"], classifier={
        "kind": "model", "factory": f"{__name__}:keyword_model", "params": {"word": "forbidden"},
        "threshold": 0.5})
    d = cfg.build(ctx).process(table([chat(0, "forbidden in prompt only", "fine"),
                                      chat(1, "q", "a forbidden answer")]))
    assert d.keep.tolist() == [True, False] and d.details[1]["category"] == "toxicity"
    with pytest.raises(CurationError, match="not found"):
        HarmfulConfig(classifier={"kind": "model", "factory": "no_such_module:f"}).build(ctx)


def test_domain_heuristics_and_labels(ctx):
    assert heuristic_domain("Compute $\\frac{3}{4} + \\frac{1}{8}$.", "The sum is $\\boxed{7/8}$.")[0] == "math"
    assert heuristic_domain("Write a Python function to reverse a list.",
                            "```python\ndef rev(xs):\n    return xs[::-1]\n```")[0] == "code"
    assert heuristic_domain("Why does a catalyst speed up a chemical reaction?",
                            "It lowers the activation energy; the reaction rate and the molecule "
                            "collisions ...")[0] == "stem"
    assert heuristic_domain("Write a haiku about autumn.", "Leaves fall softly.")[0] == "other"
    rows = [chat(0, "Write a haiku about autumn.", "Leaves fall", domain="Mathematics"),
            chat(1, "Write a haiku about autumn.", "Leaves fall")]
    d = DomainTagConfig(keep=["math"]).build(ctx).process(table(rows))
    assert d.columns["_domain"] == ["math", "other"]
    assert d.keep.tolist() == [True, False] and d.reasons[1] == "domain_not_kept"
    import json
    assert json.loads(d.columns["_raw"][0])["domain"] == "Mathematics"   # existing label not overwritten
    d = DomainTagConfig(overwrite=True).build(ctx).process(table(rows))
    assert json.loads(d.columns["_raw"][0])["domain"] == "math"
