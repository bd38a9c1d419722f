"""Instruction following: the 25 instruction ids of IFEval (Zhou et al. 2023), with the
semantics of the reference checker (google-research ``instruction_following_eval``, as
shipped in lm-eval's ``tasks/ifeval``), re-implemented here; the test suite compares the
two on generated (instruction, kwargs, response) triples.

Reference (``row.reference``), either IFEval's own row layout::

    {"instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
     "kwargs": [{}, {"relation": "less than", "num_words": 50}]}

or a list of instructions, each an id (or a short alias, below) with its kwargs inline::

    {"instructions": [{"type": "no_commas"}, {"type": "word_count", "relation": "at most", "n": 50}]}

plus ``"mode": "strict" | "loose"`` (default strict) and ``"scoring": "all"`` (default: 1
only if every instruction holds) or ``"fraction"``. Loose mode, as in IFEval, also accepts
the response without its first line, its last line, both, and/or every ``*``.
``"grading": "reference"`` (default: the reference checker's verdicts, for evaluation) or
``"strict"`` (for RL rewards: also rejects lookalike characters, padding, keywords inside
other words, empty placeholders/titles/JSON, postscripts that are not one, ...: see
``ifeval_strict.py``). Grading is independent of IFEval's strict/loose ``mode``.

Where this differs from the reference, on purpose:
- ``length_constraints:number_sentences``: the reference counts with NLTK's Punkt English
  model, which no PyPI package installs; we count with the rule-based splitter the
  reference ships (``split_into_sentences``: abbreviations, initials, decimals, acronyms,
  web addresses, ellipses), re-implemented in ``split_sentences`` (``ifeval_text.py``).
- ``change_case:capital_word_frequency``: the reference tokenizes with ``nltk.word_tokenize``
  (Punkt again, to split sentences first); ``words_treebank`` splits sentences with
  ``split_sentences`` and words with NLTK's Treebank rules, re-implemented.
- Relations: besides the reference's "less than" and "at least", "at most", "more than"
  and "exactly" are accepted (the reference raises for them).
- Kwargs must be given: the reference draws missing ones at random, we raise naming them.
- ``startend:start_with`` (alias ``start_with``) is ours: the reference has no start check.
Languages are detected with ``langdetect`` (seeded, so the same text always gets the same
answer); as in the reference, text it cannot classify counts as followed.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .ifeval_text import detect_language, split_sentences, words_treebank
from .registry import register_verifier
from .schema import Reward, TaskRow

GRADINGS = ("reference", "strict")  # "strict": ifeval_strict.py's categories too (for RL rewards)
RELATIONS: dict[str, Callable[[int, int], bool]] = {
    "less than": lambda v, n: v < n, "at least": lambda v, n: v >= n,  # the reference's two
    "at most": lambda v, n: v <= n, "more than": lambda v, n: v > n, "exactly": lambda v, n: v == n,
}
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


@dataclass(frozen=True)
class Instruction:
    id: str
    check: Callable[..., bool]
    kwargs: tuple[str, ...]  # all required


INSTRUCTIONS: dict[str, Instruction] = {}


def instruction(iid: str, *kwargs: str):
    def deco(fn: Callable[..., bool]) -> Callable[..., bool]:
        INSTRUCTIONS[iid] = Instruction(iid, fn, kwargs)
        return fn

    return deco


def _compare(value: int, relation: str, n: int) -> bool:
    try:
        return RELATIONS[relation](value, n)
    except KeyError:
        raise ValueError(f"unknown relation {relation!r}; known: {sorted(RELATIONS)}") from None


# ---- the 25 instruction ids -----------------------------------------------------------------
@instruction("keywords:existence", "keywords")
def _existence(text, keywords):
    return all(re.search(k, text, flags=re.IGNORECASE) for k in keywords)


@instruction("keywords:frequency", "keyword", "frequency", "relation")
def _frequency(text, keyword, frequency, relation):
    return _compare(len(re.findall(keyword.strip(), text, flags=re.IGNORECASE)), relation, frequency)


@instruction("keywords:forbidden_words", "forbidden_words")
def _forbidden(text, forbidden_words):
    return not any(re.search(r"\b" + w + r"\b", text, flags=re.IGNORECASE) for w in forbidden_words)


@instruction("keywords:letter_frequency", "letter", "let_frequency", "let_relation")
def _letters(text, letter, let_frequency, let_relation):
    return _compare(Counter(text.lower())[letter.strip().lower()], let_relation, let_frequency)


@instruction("language:response_language", "language")
def _language(text, language):
    got = detect_language(text)
    return got is None or got == language


@instruction("length_constraints:number_sentences", "num_sentences", "relation")
def _sentences(text, num_sentences, relation):
    return _compare(len(split_sentences(text)), relation, num_sentences)


@instruction("length_constraints:number_paragraphs", "num_paragraphs")
def _paragraphs(text, num_paragraphs):
    parts = re.split(r"\s?\*\*\*\s?", text)
    inner_empty = any(not p.strip() for p in parts[1:-1])
    return not inner_empty and sum(1 for p in parts if p.strip()) == num_paragraphs


@instruction("length_constraints:number_words", "num_words", "relation")
def _words(text, num_words, relation):
    return _compare(len(re.findall(r"\w+", text)), relation, num_words)


@instruction("length_constraints:nth_paragraph_first_word", "num_paragraphs", "nth_paragraph", "first_word")
def _nth_first_word(text, num_paragraphs, nth_paragraph, first_word):
    if not 1 <= nth_paragraph <= num_paragraphs:
        raise ValueError(f"nth_paragraph must be between 1 and num_paragraphs ({num_paragraphs}), got {nth_paragraph}")
    parts = text.split("\n\n")
    count = sum(1 for p in parts if p.strip())
    if nth_paragraph > count or not parts[nth_paragraph - 1].strip():
        return False
    word = parts[nth_paragraph - 1].strip().split()[0].strip().lstrip("'").lstrip('"')
    head = re.match(r"[^.,?!'\"]*", word).group(0).lower()
    return count == num_paragraphs and head == first_word.lower()


@instruction("detectable_content:number_placeholders", "num_placeholders")
def _placeholders(text, num_placeholders):
    return len(re.findall(r"\[.*?\]", text)) >= num_placeholders


@instruction("detectable_content:postscript", "postscript_marker")
def _postscript(text, postscript_marker):
    marker = postscript_marker.strip()
    pattern = {"P.P.S": r"\s*p\.\s?p\.\s?s.*$", "P.S.": r"\s*p\.\s?s\..*$"}.get(marker, r"\s*" + marker.lower() + r".*$")
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


@instruction("detectable_format:number_bullet_lists", "num_bullets")
def _bullets(text, num_bullets):
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


@instruction("detectable_format:constrained_response")
def _constrained(text):
    return any(option in text.strip() for option in CONSTRAINED_RESPONSES)


@instruction("detectable_format:number_highlighted_sections", "num_highlights")
def _highlights(text, num_highlights):
    single = [h for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", text) if h[2:-2].strip()]
    return len(single) + len(double) >= num_highlights


@instruction("detectable_format:multiple_sections", "section_spliter", "num_sections")
def _sections(text, section_spliter, num_sections):
    return len(re.split(r"\s?" + section_spliter.strip() + r"\s?\d+\s?", text)) - 1 >= num_sections


@instruction("detectable_format:json_format")
def _json(text):
    s = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):  # one after the other, as the reference does
        s = s.removeprefix(fence)
    s = s.removesuffix("```").strip()
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


@instruction("detectable_format:title")
def _title(text):
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))


@instruction("combination:two_responses")
def _two_responses(text):
    parts = text.split("******")
    if any(not p.strip() for p in parts[1:-1]):
        return False
    answers = [p for p in parts if p.strip()]
    return len(answers) == 2 and answers[0].strip() != answers[1].strip()


@instruction("combination:repeat_prompt", "prompt_to_repeat")
def _repeat_prompt(text, prompt_to_repeat):
    if not prompt_to_repeat:  # as the reference: every response would start with an empty prompt
        raise ValueError("prompt_to_repeat must be a non-empty string")
    return text.strip().lower().startswith(prompt_to_repeat.strip().lower())


@instruction("startend:end_checker", "end_phrase")
def _end(text, end_phrase):
    return text.strip().strip('"').lower().endswith(end_phrase.strip().lower())


@instruction("startend:start_with", "phrase")
def _start(text, phrase):  # ours: not a reference id
    return text.strip().lower().startswith(phrase.strip().lower())


@instruction("startend:quotation")
def _quotation(text):
    s = text.strip()
    return len(s) > 1 and s[0] == '"' and s[-1] == '"'


@instruction("change_case:capital_word_frequency", "capital_frequency", "capital_relation")
def _capital_words(text, capital_frequency, capital_relation):
    return _compare(sum(w.isupper() for w in words_treebank(text)), capital_relation, capital_frequency)


def _english_in_case(text: str, in_case: bool) -> bool:
    if not in_case:
        return False
    lang = detect_language(text)
    return lang is None or lang == "en"


@instruction("change_case:english_capital")
def _all_capitals(text):
    return _english_in_case(text, text.isupper())


@instruction("change_case:english_lowercase")
def _all_lowercase(text):
    return _english_in_case(text, text.islower())


@instruction("punctuation:no_comma")
def _no_comma(text):
    return "," not in text


# ---- the short aliases of the "instructions" layout: name -> (id, {our kwarg: its kwarg}) ----
ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    "word_count": ("length_constraints:number_words", {"n": "num_words"}),
    "sentence_count": ("length_constraints:number_sentences", {"n": "num_sentences"}),
    "paragraph_count": ("length_constraints:number_paragraphs", {"n": "num_paragraphs"}),
    "keywords_include": ("keywords:existence", {}),
    "keywords_exclude": ("keywords:forbidden_words", {"keywords": "forbidden_words"}),
    "keyword_frequency": ("keywords:frequency", {"n": "frequency"}),
    "letter_frequency": ("keywords:letter_frequency", {"relation": "let_relation", "n": "let_frequency"}),
    "json_format": ("detectable_format:json_format", {}),
    "bullet_count": ("detectable_format:number_bullet_lists", {"n": "num_bullets"}),
    "section_count": ("detectable_format:multiple_sections", {"n": "num_sections", "splitter": "section_spliter"}),
    "placeholder_count": ("detectable_content:number_placeholders", {"n": "num_placeholders"}),
    "highlight_count": ("detectable_format:number_highlighted_sections", {"n": "num_highlights"}),
    "lowercase": ("change_case:english_lowercase", {}),
    "uppercase": ("change_case:english_capital", {}),
    "start_with": ("startend:start_with", {}),
    "end_with": ("startend:end_checker", {"phrase": "end_phrase"}),
    "no_commas": ("punctuation:no_comma", {}),
    "title": ("detectable_format:title", {}),
    "quotation": ("startend:quotation", {}),
    "postscript": ("detectable_content:postscript", {"marker": "postscript_marker"}),
    "language": ("language:response_language", {"lang": "language"}),
    "constrained_response": ("detectable_format:constrained_response", {}),
    "two_responses": ("combination:two_responses", {}),
    "repeat_prompt": ("combination:repeat_prompt", {"prompt": "prompt_to_repeat"}),
    "capital_word_frequency": ("change_case:capital_word_frequency",
                               {"n": "capital_frequency", "relation": "capital_relation"}),
    "nth_paragraph_first_word": ("length_constraints:nth_paragraph_first_word", {"n": "num_paragraphs"}),
}
_ALIAS_DEFAULTS = {"section_count": {"section_spliter": "Section"}, "postscript": {"postscript_marker": "P.S."},
                   "paragraph_count": {}}


def parse_instructions(ref: dict[str, Any]) -> list[tuple[Instruction, dict[str, Any]]]:
    """The row's instructions as (instruction, kwargs); ValueError naming the bad entry."""
    if "instruction_id_list" in ref:
        ids, kwargs = ref["instruction_id_list"], ref.get("kwargs") or [{} for _ in ref["instruction_id_list"]]
        if not isinstance(ids, list) or not isinstance(kwargs, list) or len(ids) != len(kwargs):
            raise ValueError("ifeval reference: instruction_id_list and kwargs must be lists of the same length")
        entries = [(iid, {k: v for k, v in (kw or {}).items() if v is not None}, f"instruction_id_list[{i}]")
                   for i, (iid, kw) in enumerate(zip(ids, kwargs))]
    else:
        raw = ref.get("instructions")
        if not isinstance(raw, list) or not raw or not all(isinstance(x, dict) and "type" in x for x in raw):
            raise ValueError("ifeval reference needs a non-empty 'instructions' list of {'type': ..., ...} "
                             "or IFEval's 'instruction_id_list' + 'kwargs'")
        entries = []
        for i, inst in enumerate(raw):
            name, kw = inst["type"], {k: v for k, v in inst.items() if k != "type"}
            if name in ALIASES:
                iid, rename = ALIASES[name]
                kw = {**_ALIAS_DEFAULTS.get(name, {}), **{rename.get(k, k): v for k, v in kw.items()}}
            else:
                iid = name
            entries.append((iid, kw, f"instructions[{i}]"))
    out = []
    for iid, kw, where in entries:
        inst = INSTRUCTIONS.get(iid)
        if inst is None:
            raise ValueError(f"ifeval reference {where}: unknown instruction {iid!r}; known: {sorted(INSTRUCTIONS)} "
                             f"and aliases {sorted(ALIASES)}")
        missing = [k for k in inst.kwargs if k not in kw]
        extra = [k for k in kw if k not in inst.kwargs]
        if missing or extra:
            raise ValueError(f"ifeval reference {where} ({iid}): " + "; ".join(
                x for x in (f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else "") if x))
        out.append((inst, kw))
    return out


def with_grading(rows: list[dict[str, Any]], grading: str) -> list[dict[str, Any]]:
    """The rows, where an ifeval row whose reference names no grading gets `grading` (an RL
    reward passes "strict"; a row that chose its grading keeps it)."""
    if grading not in GRADINGS:
        raise ValueError(f"ifeval grading must be one of {list(GRADINGS)}, got {grading!r}")
    out = []
    for row in rows:
        ref = row.get("reference")
        if row.get("domain") == "ifeval" and isinstance(ref, dict) and "grading" not in ref:
            row = {**row, "reference": {**ref, "grading": grading}}
        out.append(row)
    return out


def loose_variants(text: str) -> list[str]:
    lines = text.split("\n")
    bases = [text, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return list(dict.fromkeys(v for b in bases for v in (b, b.replace("*", "")) if v.strip()))


def followed(text: str, inst: Instruction, kwargs: dict[str, Any], mode: str = "strict",
             grading: str = "reference") -> bool:
    return why_not_followed(text, inst, kwargs, mode, grading) is None


def why_not_followed(text: str, inst: Instruction, kwargs: dict[str, Any], mode: str = "strict",
                     grading: str = "reference") -> str | None:
    """None if some variant of the text (one in IFEval's strict mode, eight in loose mode)
    follows the instruction; else why the first variant does not. ``grading="strict"`` adds
    ``ifeval_strict``'s categories to the reference check."""
    from .ifeval_strict import problem  # a cycle: ifeval_strict builds on this module

    variants = [text] if mode == "strict" else loose_variants(text)
    first = None
    for v in variants:
        why = None if v.strip() and inst.check(v, **kwargs) else "not followed"
        if why is None and grading == "strict":
            why = problem(v, inst.id, kwargs)
        if why is None:
            return None
        first = first or why
    return first or "empty response"


@register_verifier("ifeval")
def verify_ifeval(row: TaskRow, text: str) -> Reward:
    ref = row.reference if isinstance(row.reference, dict) else {}
    instructions = parse_instructions(ref)
    mode, grading = ref.get("mode", "strict"), ref.get("grading", "reference")
    if mode not in ("strict", "loose"):
        raise ValueError(f"ifeval reference: mode must be 'strict' or 'loose', got {mode!r}")
    if grading not in GRADINGS:
        raise ValueError(f"ifeval reference: grading must be one of {list(GRADINGS)}, got {grading!r}")
    if not text.strip():
        return Reward.zero("empty response", source="response")
    whys = [why_not_followed(text, inst, kw, mode, grading) for inst, kw in instructions]
    results = [w is None for w in whys]
    n_ok = sum(results)
    score = n_ok / len(results) if ref.get("scoring") == "fraction" else float(all(results))
    failed = [f"{inst.id} ({why})" if why != "not followed" else inst.id
              for (inst, _), why in zip(instructions, whys) if why is not None]
    reason = (f"{n_ok}/{len(results)} instructions followed ({mode}, {grading} grading)"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
    return Reward(score=score, reason=reason, source="response",
                  details={"followed": results, "mode": mode, "grading": grading})
