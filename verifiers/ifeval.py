"""Instruction following, IFEval style: a list of checkable constraints per row.

Reference: {"instructions": [{"type": ..., ...kwargs}, ...], "mode": "strict"|"loose",
"scoring": "all" (default: 1 only if every instruction holds) | "fraction"}.

Loose mode (as in IFEval) also accepts the response with its first line removed, its last
line removed, both removed, and/or markdown emphasis (``*``) removed; strict checks the
response as written. Constraint types and their kwargs:

- word_count / sentence_count / paragraph_count: relation ("at least", "at most",
  "less than", "more than", "exactly"), n. Paragraphs are split on blank lines or ``***``.
- keywords_include: keywords (all must occur, case-insensitive, whole words)
- keywords_exclude: keywords (none may occur)
- keyword_frequency: keyword, relation, n
- letter_frequency: letter, relation, n (case-insensitive)
- json_format: the whole response is JSON (a ```json fence around it is allowed)
- bullet_count: n (exactly n lines starting with "* " or "- ")
- section_count: n, splitter (default "Section"): at least n sections "Section 1", ...
- placeholder_count: n (at least n square-bracket placeholders like [address])
- highlight_count: n (at least n *highlighted* spans)
- lowercase / uppercase: the whole response in lower / upper case letters
- start_with / end_with: phrase (end ignores trailing whitespace)
- no_commas
- title: a title wrapped in double angular brackets <<like this>>
- quotation: the whole response wrapped in double quotes
- postscript: marker (default "P.S."): a postscript starting with the marker
- language: lang (ISO code). Detected offline from the script (ru, uk/ru Cyrillic, zh, ja,
  ko, ar, hi, el, he, th) or, for Latin-script languages (en, es, fr, de, it, pt, nl),
  from stopword counts. A heuristic: fine for whole paragraphs, not for a few words.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .registry import register_verifier
from .schema import Reward, TaskRow

Check = Callable[..., bool]
CHECKS: dict[str, Check] = {}


def check(name: str):
    def deco(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn

    return deco


def compare(value: int, relation: str, n: int) -> bool:
    rel = relation.strip().lower()
    if rel in ("at least", ">="):
        return value >= n
    if rel in ("at most", "<="):
        return value <= n
    if rel in ("less than", "<"):
        return value < n
    if rel in ("more than", ">"):
        return value > n
    if rel in ("exactly", "=", "=="):
        return value == n
    raise ValueError(f"unknown relation {relation!r}")


def words(text: str) -> list[str]:
    return re.findall(r"\b[\w'-]+\b", text)


def sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+|\n+", text.strip())
    return [p for p in parts if re.search(r"\w", p)]


def paragraphs(text: str) -> list[str]:
    parts = re.split(r"\n\s*\n|\s*\*\*\*\s*", text.strip())
    return [p for p in parts if p.strip()]


@check("word_count")
def _wc(text, relation, n):
    return compare(len(words(text)), relation, n)


@check("sentence_count")
def _sc(text, relation, n):
    return compare(len(sentences(text)), relation, n)


@check("paragraph_count")
def _pc(text, n, relation="exactly"):
    return compare(len(paragraphs(text)), relation, n)


@check("keywords_include")
def _ki(text, keywords):
    return all(re.search(rf"\b{re.escape(k)}\b", text, re.IGNORECASE) for k in keywords)


@check("keywords_exclude")
def _ke(text, keywords):
    return not any(re.search(rf"\b{re.escape(k)}\b", text, re.IGNORECASE) for k in keywords)


@check("keyword_frequency")
def _kf(text, keyword, relation, n):
    return compare(len(re.findall(rf"\b{re.escape(keyword)}\b", text, re.IGNORECASE)), relation, n)


@check("letter_frequency")
def _lf(text, letter, relation, n):
    return compare(text.lower().count(letter.lower()), relation, n)


@check("json_format")
def _json(text):
    s = text.strip()
    m = re.fullmatch(r"```(?:json|JSON)?\s*\n?(.*?)\n?```", s, re.DOTALL)
    if m:
        s = m.group(1)
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


@check("bullet_count")
def _bc(text, n):
    return len(re.findall(r"^\s*[*-]\s+\S", text, re.MULTILINE)) == n


@check("section_count")
def _sec(text, n, splitter="Section"):
    return len(re.findall(rf"^\s*{re.escape(splitter)}\s+\d+", text, re.MULTILINE | re.IGNORECASE)) >= n


@check("placeholder_count")
def _ph(text, n):
    return len(re.findall(r"\[[^\[\]\n]+\]", text)) >= n


@check("highlight_count")
def _hl(text, n):
    return len([h for h in re.findall(r"\*([^*\n]+)\*", text) if h.strip()]) >= n


@check("lowercase")
def _lower(text):
    return text == text.lower() and any(c.isalpha() for c in text)


@check("uppercase")
def _upper(text):
    return text == text.upper() and any(c.isalpha() for c in text)


@check("start_with")
def _start(text, phrase):
    return text.strip().lower().startswith(phrase.strip().lower())


@check("end_with")
def _end(text, phrase):
    return text.strip().lower().endswith(phrase.strip().lower())


@check("no_commas")
def _nocomma(text):
    return "," not in text and "，" not in text


@check("title")
def _title(text):
    return any(t.strip() for t in re.findall(r"<<([^\n]+?)>>", text))


@check("quotation")
def _quote(text):
    s = text.strip()
    return len(s) > 1 and s[0] == '"' and s[-1] == '"'


@check("postscript")
def _ps(text, marker="P.S."):
    return re.search(rf"^\s*{re.escape(marker)}", text, re.MULTILINE | re.IGNORECASE) is not None


_SCRIPTS = {"ru": r"[\u0400-\u04FF]", "uk": r"[\u0400-\u04FF]", "zh": r"[\u4E00-\u9FFF]", "ja": r"[\u3040-\u30FF]",
            "ko": r"[\uAC00-\uD7AF]", "ar": r"[\u0600-\u06FF]", "hi": r"[\u0900-\u097F]", "el": r"[\u0370-\u03FF]",
            "he": r"[\u0590-\u05FF]", "th": r"[\u0E00-\u0E7F]"}
_STOPWORDS = {
    "en": "the and of to is in that it was for on are with as be this have not but they you",
    "es": "el la de que y en los se del las por un una es con para no su al lo como",
    "fr": "le la les de des et est un une que en du dans pour pas qui sur au il elle",
    "de": "der die das und ist nicht ein eine zu den mit von sich des auf für im dem ich",
    "it": "il di che la e un una per non sono del della gli le si con da in è",
    "pt": "o a de que e do da em um uma para com não os as no na se por",
    "nl": "de het een en van is dat niet op te in zijn met voor ik er aan",
}


def detect_language(text: str) -> str | None:
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return None
    for lang, pat in _SCRIPTS.items():
        if lang == "uk":
            continue
        if len(re.findall(pat, text)) / len(letters) > 0.3:
            return lang
    toks = [w.lower() for w in words(text)]
    scores = {lang: sum(t in set(sw.split()) for t in toks) for lang, sw in _STOPWORDS.items()}
    best = max(scores, key=scores.get)
    return best if scores[best] > 0 else None


@check("language")
def _lang(text, lang):
    want = lang.lower()
    got = detect_language(text)
    return got == want or (want == "uk" and got == "ru")


def loose_variants(text: str) -> list[str]:
    lines = text.split("\n")
    bases = [text, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    out = []
    for b in bases:
        out += [b, b.replace("*", "")]
    return [v for v in dict.fromkeys(out) if v.strip()]


def check_instruction(text: str, inst: dict[str, Any], mode: str = "strict") -> bool:
    kwargs = {k: v for k, v in inst.items() if k != "type"}
    fn = CHECKS.get(inst["type"])
    if fn is None:
        raise ValueError(f"unknown instruction type {inst['type']!r}; known: {sorted(CHECKS)}")
    variants = [text] if mode == "strict" else loose_variants(text)
    return any(fn(v, **kwargs) for v in variants)


@register_verifier("ifeval")
def verify_ifeval(row: TaskRow, text: str) -> Reward:
    ref = row.reference if isinstance(row.reference, dict) else {}
    instructions = ref.get("instructions") or []
    if not instructions:
        raise ValueError("ifeval reference needs a non-empty 'instructions' list")
    mode = ref.get("mode", "strict")
    if not text.strip():
        return Reward.zero("empty response")
    results = [check_instruction(text, inst, mode) for inst in instructions]
    n_ok = sum(results)
    score = n_ok / len(results) if ref.get("scoring") == "fraction" else float(all(results))
    failed = [inst["type"] for inst, ok in zip(instructions, results) if not ok]
    reason = f"{n_ok}/{len(results)} instructions followed ({mode})" + (f"; failed: {', '.join(failed)}" if failed else "")
    return Reward(score=score, extracted=None, reason=reason,
                  details={"followed": results, "mode": mode})
