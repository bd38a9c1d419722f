"""Domain tagging into the paper's four SFT domains: math, stem, code, other.

A row's own label (`domain` field) is used when it names one of the four (or a known
synonym: "science" -> stem, "programming" -> code, ...) and `trust_existing` is on.
Otherwise a keyword/syntax heuristic scores the row: code fences and code syntax for
code; LaTeX, equations and mathematical vocabulary for math; science vocabulary for
stem. The highest score at or above `min_score` wins (ties: math, stem, code), else
"other". The tag is written into the row (`write_field`) and can filter rows (`keep`).
The engine uses the same tagger for the before/after domain mix of the report.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

import numpy as np
from pydantic import Field

from data_curation._base import bump
from data_curation.row_schema import dump_row
from data_curation.step_api import Decision, RunContext, StepConfig, StepRunner

Domain = Literal["math", "stem", "code", "other"]
SYNONYMS = {
    "math": "math", "maths": "math", "mathematics": "math", "stem": "stem", "science": "stem",
    "physics": "stem", "chemistry": "stem", "biology": "stem", "engineering": "stem",
    "code": "code", "coding": "code", "programming": "code", "other": "other",
    "general": "other", "chat": "other",
}

MATH_TERMS = (
    "equation equations integer integers prime primes polynomial polynomials probability "
    "triangle triangles circle circles derivative integral theorem prove proof solve sum "
    "product divisible remainder digits fraction fractions ratio area perimeter radius angle "
    "angles modulo gcd lcm factorial matrix matrices vector vectors logarithm sequence series "
    "inequality inequalities real rational irrational quadratic roots coefficient function "
    "functions compute calculate evaluate simplify geometric arithmetic combinatorics plus "
    "minus times divided percent percentage average"
).split()
STEM_TERMS = (
    "physics chemistry biology molecule molecules atom atoms electron electrons proton neutron "
    "velocity acceleration force forces energy momentum joule joules watt watts voltage current "
    "resistance circuit magnetic electric wavelength frequency photon quantum thermodynamic "
    "thermodynamics entropy reaction reactions compound compounds acid acids enzyme enzymes "
    "protein proteins dna rna cell cells gene genes genome species evolution photosynthesis "
    "organism organisms bacteria virus mass density pressure temperature gravity orbit planet "
    "planets chemical element elements isotope mole molar concentration catalyst kinetic "
    "friction newton oxidation ion ions bond bonds metabolism ecosystem"
).split()
CODE_TERMS = (
    "python javascript typescript java rust golang kotlin swift sql bash c++ function class "
    "method variable array list dictionary loop recursion compile compiler runtime api "
    "algorithm implement debug bug exception stack queue hashmap json regex"
).split()

_FENCE = re.compile(r"```")
_CODE_SYNTAX = re.compile(
    r"(?m)^\s*(?:def \w+\(|class \w+[:(]|#include\b|import \w+|from \w+ import|function \w+\(|"
    r"public (?:static )?\w+|fn \w+\(|for \(.*;.*;|if __name__|console\.log|print\(|return\b.*;?$|"
    r"SELECT\b|let \w+ =|const \w+ =)")
_LATEX = re.compile(r"\\(?:frac|sqrt|boxed|sum|int|cdot|times|pi|theta|alpha|beta|le|ge|neq|"
                    r"binom|lfloor|rfloor|infty|log|sin|cos|tan)\b|\$[^$\n]{1,200}\$")
_EQUATION = re.compile(r"\d\s*[-+*/^=<>]\s*\d|[a-z]\s*[\^=]\s*\d")
_WORD = re.compile(r"[a-z][a-z+]*")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")


def heuristic_domain(prompt: str, response: str, min_score: float = 2.0,
                     extra: dict[str, set[str]] | None = None) -> tuple[str, dict[str, float]]:
    text = f"{prompt}\n{response}"
    low = text.lower()
    words = set(_WORD.findall(low))
    extra = extra or {}
    code = 3.0 * min(2, len(_FENCE.findall(text)) // 2) + min(4, len(_CODE_SYNTAX.findall(text)))
    code += 0.5 * len(words & (_CODE_SET | extra.get("code", set())))
    math = min(4, len(_LATEX.findall(text))) + min(2, len(_EQUATION.findall(low)))
    math += 0.5 * len(words & (_MATH_SET | extra.get("math", set())))
    math += min(1.0, len(_NUMBER.findall(text)) / 6)
    stem = 0.75 * len(words & (_STEM_SET | extra.get("stem", set())))
    scores = {"math": math, "stem": stem, "code": code}
    best = max(("math", "stem", "code"), key=lambda d: scores[d])  # ties: math, stem, code
    return (best if scores[best] >= min_score else "other"), scores


_MATH_SET, _STEM_SET, _CODE_SET = set(MATH_TERMS), set(STEM_TERMS), set(CODE_TERMS)


class DomainTagConfig(StepConfig):
    step: Literal["domain_tag"] = "domain_tag"
    trust_existing: bool = Field(True, description="use the row's own domain label when it names "
                                                   "one of the four domains (or a synonym)")
    source_field: str | None = Field(None, description="field of the existing label (default: "
                                                       "the field map's `domain`)")
    write_field: str | None = Field("domain", description="write the tag into rows under this "
                                                          "key (None: do not write)")
    overwrite: bool = False
    keep: list[Domain] | None = Field(None, description="remove rows of other domains")
    min_score: float = Field(2.0, gt=0)
    extra_terms: dict[Literal["math", "stem", "code"], list[str]] = {}

    def build(self, ctx: RunContext) -> "DomainTagger":
        return DomainTagger(self, self.source_field or ctx.fields.domain)


class DomainTagger(StepRunner):
    mode = "rows"

    def __init__(self, cfg: DomainTagConfig, source_field: str):
        self.cfg = cfg
        self.source_field = source_field
        self.extra = {k: {w.lower() for w in v} for k, v in cfg.extra_terms.items()}

    def tag(self, obj: dict | None, prompt: str, response: str) -> tuple[str, str]:
        """(domain, "label" | "heuristic")."""
        if self.cfg.trust_existing and isinstance(obj, dict):
            v = obj.get(self.source_field)
            if isinstance(v, str) and v.strip().lower() in SYNONYMS:
                return SYNONYMS[v.strip().lower()], "label"
        return heuristic_domain(prompt, response, self.cfg.min_score, self.extra)[0], "heuristic"

    def domains(self, table) -> list[str]:
        """Domain of each row (for reports; no writing)."""
        raws = table.column("_raw").to_pylist()
        if "_domain" in table.column_names:
            have = table.column("_domain").to_pylist()
        else:
            have = [None] * len(raws)
        prompts = table.column("_prompt").to_pylist()
        responses = table.column("_response").to_pylist()
        out = []
        for raw, d, p, r in zip(raws, have, prompts, responses):
            if d is None:
                obj = json.loads(raw) if (self.cfg.trust_existing and self.source_field in raw) else None
                d = self.tag(obj, p, r)[0]
            out.append(d)
        return out

    def process(self, table) -> Decision:
        c = self.cfg
        n = table.num_rows
        raws = table.column("_raw").to_pylist()
        prompts = table.column("_prompt").to_pylist()
        responses = table.column("_response").to_pylist()
        keep = np.ones(n, dtype=bool)
        reasons: list[str | None] = [None] * n
        details: list[dict | None] = [None] * n
        new_raw = list(raws)
        doms: list[str] = []
        stats: dict[str, Any] = {"input_mix": {}, "by_source": {}, "written": 0}
        for i in range(n):
            needs_obj = (c.trust_existing and self.source_field in raws[i]) or c.write_field
            obj = json.loads(raws[i]) if needs_obj else None
            d, src = self.tag(obj, prompts[i], responses[i])
            doms.append(d)
            bump(stats["input_mix"], d)
            bump(stats["by_source"], src)
            if c.keep is not None and d not in c.keep:
                keep[i] = False
                reasons[i] = "domain_not_kept"
                details[i] = {"domain": d, "keep": list(c.keep)}
                continue
            if c.write_field and isinstance(obj, dict) and (c.overwrite or obj.get(c.write_field) is None):
                obj[c.write_field] = d
                new_raw[i] = dump_row(obj)
                stats["written"] += 1
        return Decision(keep, reasons, details, {"_raw": new_raw, "_domain": doms}, stats)
