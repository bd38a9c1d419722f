"""Harmful-content filter: a pluggable classifier; rules shipped, models hooked in.

A classifier is anything with `classify(texts: list[str]) -> list[dict[str, float]]`
(category -> score in [0, 1] per text; absent categories score 0). A row is removed when
a checked field (prompt and/or response) scores at or above the threshold in any
category; the reason names the category, the field and the evidence.

- `kind: rules` (shipped): per category, whole-word terms/phrases matched on the
  normalised text (NFKC, case-folded, zero-width characters removed, so "b\u200bomb"
  is "bomb") and regex patterns on the same text with punctuation kept. The defaults
  target requests for operational harm (weapons, chemical/biological agents, malware,
  self-harm methods, sexual content involving minors), not topics: a chemistry question
  about explosives' enthalpy is not matched. Replace or extend them in the config.
- `kind: model`: `factory: "package.module:callable"` is imported in each worker and
  called with `params`; it returns a classifier object. `transformers_classifier` below
  adapts any Hugging Face text-classification model.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field

from data_curation._base import CurationError, Strict, bump
from data_curation.normalize import NormalizeConfig, Normalizer
from data_curation.step_api import Decision, RunContext, StepConfig, StepRunner


class HarmClassifier(Protocol):
    def classify(self, texts: list[str]) -> list[dict[str, float]]: ...


class CategoryRules(Strict):
    terms: list[str] = Field([], description="words/phrases, matched as whole words after "
                                             "normalisation")
    patterns: list[str] = Field([], description="regexes on the normalised text (punctuation kept)")
    min_hits: int = Field(1, ge=1, description="matches needed for a score of 1")


_HOW = (r"(?:how (?:do|can|would|should) (?:i|you|we|one)|how to|steps? (?:to|for)|instructions? (?:to|for)"
        r"|guide (?:to|for)|teach me (?:to|how to)|help me)")
DEFAULT_CATEGORIES: dict[str, CategoryRules] = {
    "weapons": CategoryRules(patterns=[
        _HOW + r" (?:make|build|assemble|construct|manufacture) (?:a |an |my own )?(?:pipe ?bomb|bomb|"
        r"explosive device|ied|molotov cocktail|nail bomb|suicide vest|ghost gun)",
        r"(?:untraceable|unregistered) (?:firearm|gun|weapon)s? (?:at home|without)",
    ]),
    "chemical_biological": CategoryRules(patterns=[
        r"(?:synthesi[sz]e|make|produce|cultivate|weaponi[sz]e|aerosoli[sz]e|extract) (?:some |the )?"
        r"(?:sarin|soman|tabun|vx(?: nerve agent)?|novichok|ricin|abrin|anthrax|botulinum toxin|"
        r"mustard gas|nerve agents?)",
    ]),
    "malware": CategoryRules(patterns=[
        r"(?:write|create|build|code|develop|give me) (?:a |an |some |me a )?(?:working )?(?:ransomware|"
        r"keylogger|credential stealer|info ?stealer|botnet|rootkit|remote access trojan)",
        r"(?:undetectable|fud|evade (?:antivirus|edr|detection)).{0,40}(?:payload|malware|trojan)",
    ]),
    "self_harm": CategoryRules(patterns=[
        r"(?:best|easiest|quickest|fastest|painless|surest) (?:way|ways|method|methods) to "
        r"(?:kill myself|commit suicide|end my life|hurt myself)",
        _HOW + r" (?:kill myself|commit suicide|end my life)",
    ]),
    "sexual_minors": CategoryRules(patterns=[
        r"(?:sexual|explicit|erotic|nude|naked) (?:content|images?|pictures?|photos?|stor(?:y|ies)|"
        r"roleplay) (?:of|involving|with|about) (?:a |an )?(?:minors?|child|children|kids?|"
        r"(?:1[0-7]|[1-9])[- ]year[- ]olds?)",
    ]),
}


class RuleClassifierConfig(Strict):
    kind: Literal["rules"] = "rules"
    categories: dict[str, CategoryRules] | None = Field(
        None, description="replaces the default categories (None: the defaults)")
    extra_categories: dict[str, CategoryRules] = Field({}, description="added to / override "
                                                                       "the categories by name")
    normalize: NormalizeConfig = NormalizeConfig(punctuation="keep", latex=False)


class ModelClassifierConfig(Strict):
    kind: Literal["model"] = "model"
    factory: str = Field(description="'package.module:callable' returning a classifier")
    params: dict[str, Any] = {}
    threshold: float = Field(0.5, gt=0, le=1)
    batch_size: int = Field(32, ge=1)


class RuleClassifier:
    def __init__(self, cfg: RuleClassifierConfig):
        cats = dict(DEFAULT_CATEGORIES if cfg.categories is None else cfg.categories)
        cats.update(cfg.extra_categories)
        self.norm = Normalizer(cfg.normalize)
        self.word_norm = Normalizer(NormalizeConfig(latex=False))
        self.rules: list[tuple[str, re.Pattern | None, list[re.Pattern], int]] = []
        for name, rules in cats.items():
            terms = [self.word_norm.text(t) for t in rules.terms]
            terms = [t for t in terms if t]
            term_re = re.compile(r"(?:^| )(?:" + "|".join(map(re.escape, sorted(terms, key=len, reverse=True)))
                                 + r")(?= |$)") if terms else None
            try:
                pats = [re.compile(p) for p in rules.patterns]
            except re.error as e:
                raise CurationError(f"harmful: category {name!r}: bad regex: {e}") from e
            self.rules.append((name, term_re, pats, rules.min_hits))

    def classify(self, texts: list[str]) -> list[dict[str, float]]:
        return [{k: v for k, (v, _) in self.explain(t).items()} for t in texts]

    def explain(self, text: str) -> dict[str, tuple[float, str]]:
        """category -> (score, evidence) for categories with at least one match."""
        prepared = " ".join(self.norm.prepare(text).split())
        words = None
        out: dict[str, tuple[float, str]] = {}
        for name, term_re, pats, min_hits in self.rules:
            hits, evidence = 0, ""
            if term_re is not None:
                words = words if words is not None else self.word_norm.text(text)
                found = term_re.findall(words)
                if found:
                    hits += len(found)
                    evidence = found[0].strip()
            for p in pats:
                found = [m.group(0) for m in p.finditer(prepared)]
                if found:
                    hits += len(found)
                    evidence = evidence or found[0]
            if hits:
                out[name] = (min(1.0, hits / min_hits), evidence[:200])
        return out


def load_factory(spec: str, params: dict[str, Any]) -> HarmClassifier:
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise CurationError(f"harmful: classifier factory {spec!r} must look like 'package.module:callable'")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise CurationError(f"harmful: cannot load classifier factory {spec!r}: {e}") from e
    clf = fn(**params)
    if not callable(getattr(clf, "classify", None)):
        raise CurationError(f"harmful: {spec!r} returned {type(clf).__name__}, which has no classify(texts)")
    return clf


def transformers_classifier(model: str, labels: dict[str, str] | None = None,
                            ignore_labels: list[str] = ("safe", "neutral", "LABEL_0", "non-toxic"),
                            max_length: int = 512, device: int | str = -1) -> HarmClassifier:
    """A Hugging Face text-classification model as a classifier: label -> category via
    `labels` (default: the label itself), `ignore_labels` are benign classes."""
    from transformers import pipeline

    pipe = pipeline("text-classification", model=model, top_k=None, truncation=True,
                    max_length=max_length, device=device)

    class _HF:
        def classify(self, texts: list[str]) -> list[dict[str, float]]:
            out = []
            for scores in pipe(list(texts)):
                cats: dict[str, float] = {}
                for s in scores:
                    if s["label"] in ignore_labels:
                        continue
                    cat = (labels or {}).get(s["label"], s["label"])
                    cats[cat] = max(cats.get(cat, 0.0), float(s["score"]))
                out.append(cats)
            return out

    return _HF()


class HarmfulConfig(StepConfig):
    step: Literal["harmful"] = "harmful"
    check: list[Literal["prompt", "response"]] = Field(["prompt", "response"], min_length=1)
    classifier: RuleClassifierConfig | ModelClassifierConfig = Field(
        default_factory=RuleClassifierConfig, discriminator="kind")
    max_examples: int = Field(5, ge=0)

    def build(self, ctx: RunContext) -> "HarmfulFilter":
        return HarmfulFilter(self)


class HarmfulFilter(StepRunner):
    mode = "rows"

    def __init__(self, cfg: HarmfulConfig):
        self.cfg = cfg
        c = cfg.classifier
        self.rules = RuleClassifier(c) if isinstance(c, RuleClassifierConfig) else None
        self._model: HarmClassifier | None = None
        if self.rules is None:   # fail early (in the main process) on a bad factory path
            mod = c.factory.partition(":")[0]
            if importlib.util.find_spec(mod) is None:
                raise CurationError(f"harmful: classifier module {mod!r} not found")

    def _scores(self, texts: list[str]) -> list[dict[str, tuple[float, str]]]:
        if self.rules is not None:
            return [self.rules.explain(t) for t in texts]
        c = self.cfg.classifier
        if self._model is None:   # built lazily: once per worker process
            self._model = load_factory(c.factory, c.params)
        out: list[dict[str, tuple[float, str]]] = []
        for s in range(0, len(texts), c.batch_size):
            for scores in self._model.classify(texts[s:s + c.batch_size]):
                out.append({k: (float(v), "") for k, v in scores.items()})
        return out

    def process(self, table) -> Decision:
        n = table.num_rows
        threshold = 1.0 if self.rules is not None else self.cfg.classifier.threshold
        cols = {"prompt": table.column("_prompt").to_pylist(),
                "response": table.column("_response").to_pylist()}
        rows = table.column("_row").to_pylist()
        keep = np.ones(n, dtype=bool)
        reasons: list[str | None] = [None] * n
        details: list[dict | None] = [None] * n
        stats: dict[str, Any] = {"by_category": {}, "by_field": {}, "examples": []}
        for part in self.cfg.check:
            idx = [i for i, t in enumerate(cols[part]) if t and keep[i]]
            for i, scores in zip(idx, self._scores([cols[part][i] for i in idx])):
                flagged = {k: v for k, v in scores.items() if v[0] >= threshold}
                if not flagged:
                    continue
                cat = max(flagged, key=lambda k: flagged[k][0])
                score, evidence = flagged[cat]
                keep[i] = False
                reasons[i] = "harmful"
                details[i] = {"category": cat, "score": round(score, 4), "field": part,
                              "evidence": evidence}
                bump(stats["by_category"], cat)
                bump(stats["by_field"], part)
                if len(stats["examples"]) < self.cfg.max_examples:
                    stats["examples"].append({"row": rows[i], **details[i]})
        return Decision(keep, reasons, details, stats=stats)

    def summarize(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {**stats, "examples": stats.get("examples", [])[: self.cfg.max_examples]}
