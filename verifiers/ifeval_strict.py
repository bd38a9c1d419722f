"""IFEval's ``strict`` grading: what an RL reward should not pay for, by category.

The reference checks (``ifeval.py``, for evaluation) accept responses a policy can learn to
produce instead of following the instruction. ``grading: "strict"`` accepts a response only
if the reference check accepts it *and* its folded text, and no category below applies to
the instruction (``problem`` returns the first that does, as the reason):

- **lookalikes**: every check but the language one also runs on the text folded as a reader
  sees it (``ifeval_fold.py``: Unicode's confusables, NFKC, every mark named COMMA, format
  characters removed), with the instruction's own words folded alike: a forbidden word or
  comma must be absent however it is written (also attached to digits/underscores or spelled
  out letter by letter), a required one present as itself; small capitals read as
  capitals; a capital word is one of Latin capitals (not Greek or Cyrillic ones);
- **padding**: a counted unit (sentence, paragraph, section, bullet, highlight, placeholder,
  response) counts only if it has content (a letter or digit) and is not a repeat of another
  (case, spacing and punctuation aside); word and letter counts skip filler tokens (single
  letters other than "a"/"I", one character repeated, a word repeating the previous one,
  the words of repeated sentences); capital words need two letters and count a contraction
  once; the instruction's relation must hold for these counts too, and an exact count must
  have no padding at all; of two responses, neither may only repeat or extend the other;
- **word boundaries**: keywords count only as whole words, plural or possessive allowed
  (``cats`` has ``cat``; ``category`` and ``concatenate`` do not);
- **empty shapes**: a placeholder, title, quotation, highlight or section needs content; JSON
  must be an object or array with something in it; a postscript marker must start a line
  after the body, be followed by content and open the final paragraph (only later
  postscripts may follow it); a repeated prompt (word for word, case included), start or end
  phrase must come with an answer, and the nth paragraph with more than its first word; two
  responses stand on either side of exactly one marker of six asterisks;
- **hedging**: a constrained response names exactly one of the options, states one answer
  ("answer is yes/no/maybe" in any case) and sets no other verdict beside it ("yes or no",
  "Maybe not.").
"""
from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from typing import Any

from .ifeval import CONSTRAINED_RESPONSES, INSTRUCTIONS, RELATIONS
from .ifeval_fold import fold, fold_kwargs
from .ifeval_text import detect_language, split_sentences, words_treebank

_CONTENT = re.compile(r"[^\W_]")
_WORD = re.compile(r"[^\W_]+")  # runs of letters and digits: "a_b" is two words, as a reader sees it
_LETTER = re.compile(r"[^\W\d_]")
_PS_ANY = r"(?:p\.\s?p\.\s?s|p\.\s?s)\b\.?"


def _key(unit: str) -> str:
    return " ".join(_WORD.findall(unit.casefold()))


def _padding(units: list[str]) -> tuple[int, int]:
    """(units with content, none a repeat: the honest count; padding units)."""
    seen, honest = set(), 0
    for u in units:
        k = _key(u)
        if _meaningful(u) and k not in seen:
            honest += 1
            seen.add(k)
    return honest, len(units) - honest


def _count_problem(what: str, units: list[str], relation: str, n: int, letters: bool = False) -> str | None:
    """`letters`: a unit needs a letter ("*3*" in "2*3*4" is no highlight, "[1]" no placeholder)."""
    honest, padding = _padding([u if _LETTER.search(u) else "" for u in units] if letters else units)
    if relation == "exactly" and padding:
        return f"{padding} empty or repeated {what}"
    if not RELATIONS[relation](honest, n):
        return f"{honest} {what} with content and no repeats: not {relation} {n}"
    return None


def _filler(tokens: list[str]) -> list[bool]:
    """Per token, whether it is filler: no letter or digit, a single letter other than
    "a"/"I", one character repeated ("zzz"), or part of a run of up to 8 tokens that repeats
    the run just before it ("river river", "the river the river")."""
    low = [t.casefold() for t in tokens]
    out = [not _CONTENT.search(t) or (len(t) == 1 and t not in "ai0123456789") or (len(t) >= 3 and len(set(t)) == 1)
           for t in low]
    i = 1
    while i < len(low):
        k = next((k for k in range(1, min(8, i) + 1) if low[i:i + k] == low[i - k:i]), 0)
        for j in range(i, i + k):
            out[j] = True
        i += k or 1
    return out


def _words(text: str) -> list[str]:
    tokens = _WORD.findall(_honest_sentences(text))
    return [t for t, junk in zip(tokens, _filler(tokens)) if not junk]


def _meaningful(unit: str) -> bool:
    """A unit (sentence, bullet, placeholder, ...) with at least one word that is not filler."""
    tokens = _WORD.findall(unit)
    return any(not junk for junk in _filler(tokens))


def _honest_sentences(text: str) -> str:
    seen, kept = set(), []
    for s in split_sentences(text):
        if _key(s) not in seen:
            seen.add(_key(s))
            kept.append(s)
    return " ".join(kept)


def _has_content(text: str) -> bool:
    return bool(_CONTENT.search(text))


INFLECTION = r"(?:['\u2019]s|s|es)?"  # a keyword's plural or possessive is still the keyword


def _whole_word(pattern: str) -> str:
    return r"(?<!\w)(?:" + pattern + r")" + INFLECTION + r"(?!\w)"


# ---- the categories, per instruction id: fn(folded text, **kwargs) -> problem or None ------
STRICT: dict[str, Callable[..., str | None]] = {}


def strict(*iids: str):
    def deco(fn):
        for iid in iids:
            STRICT[iid] = fn
        return fn

    return deco


@strict("keywords:existence")
def _existence(text, keywords):
    missing = [k for k in keywords if not re.search(_whole_word(k), text, flags=re.IGNORECASE)]
    return f"keyword(s) {missing} not present as whole words" if missing else None


@strict("keywords:frequency")
def _frequency(text, keyword, frequency, relation):
    kw = keyword.strip()
    if _WORD.fullmatch(kw):  # one word: count it among the words that are not filler
        n = sum(bool(re.fullmatch(re.escape(kw) + INFLECTION, w, flags=re.IGNORECASE)) for w in _words(text))
    else:
        n = len(re.findall(_whole_word(re.escape(kw)), _honest_sentences(text), flags=re.IGNORECASE))
    return None if RELATIONS[relation](n, frequency) else \
        f"{n} whole-word uses of {keyword!r} without filler: not {relation} {frequency}"


_SPELLED = re.compile(r"(?<![^\W\d_])(?:[^\W\d_][\W_]{1,2}){2,}[^\W\d_](?![^\W\d_])")


@strict("keywords:forbidden_words")
def _forbidden(text, forbidden_words):
    # "river_bank", "river2" and a word spelled out letter by letter ("r-i-v-e-r", "r i v e r")
    # are the word to a reader; the reference's \b misses the first two, nothing sees the last
    spelled = " ".join(re.sub(r"[\W_]", "", m.group(0)) for m in _SPELLED.finditer(text))
    for w in forbidden_words:
        pattern = r"(?<![^\W\d_])(?:" + re.escape(w.strip()) + r")(?![^\W\d_])"
        if re.search(pattern, text + "\n" + spelled, flags=re.IGNORECASE):
            return f"the forbidden word {w!r} is there, attached to digits/underscores or spelled out"
    return None


@strict("keywords:letter_frequency")
def _letters(text, letter, let_frequency, let_relation):
    n = Counter("".join(_words(text)).lower())[letter.strip().lower()]
    return None if RELATIONS[let_relation](n, let_frequency) else \
        f"{n} {letter!r} outside filler tokens: not {let_relation} {let_frequency}"


@strict("length_constraints:number_sentences")
def _sentences(text, num_sentences, relation):
    return _count_problem("sentences", split_sentences(text), relation, num_sentences)


@strict("length_constraints:number_paragraphs")
def _paragraphs(text, num_paragraphs):
    parts = [p for p in re.split(r"\s?\*\*\*\s?", text) if p.strip()]
    return _count_problem("paragraphs", parts, "exactly", num_paragraphs)


@strict("length_constraints:nth_paragraph_first_word")
def _nth_first_word(text, num_paragraphs, nth_paragraph, first_word):
    parts = text.split("\n\n")
    why = _count_problem("paragraphs", [p for p in parts if p.strip()], "exactly", num_paragraphs)
    rest = parts[nth_paragraph - 1].split(None, 1)[1:]  # the reference found the paragraph and its first word
    if why is None and not (rest and _meaningful(rest[0])):
        why = f"paragraph {nth_paragraph} holds nothing but its first word"
    return why


@strict("length_constraints:number_words")
def _words_count(text, num_words, relation):
    every, n = len(_WORD.findall(text)), len(_words(text))
    if not RELATIONS[relation](every, num_words):  # "the_river_is_calm" is 4 words, not 1
        return f"{every} words (letters and digits apart from underscores): not {relation} {num_words}"
    return None if RELATIONS[relation](n, num_words) else f"{n} words without filler: not {relation} {num_words}"


@strict("detectable_content:number_placeholders")
def _placeholders(text, num_placeholders):
    found = [m.group(1) for m in re.finditer(r"\[(.*?)\](?!\()", text)]
    return _count_problem("placeholders", found, "at least", num_placeholders, letters=True)


@strict("detectable_content:postscript")
def _postscript(text, postscript_marker):
    marker = postscript_marker.strip()
    pattern = {"P.P.S": r"p\.\s?p\.\s?s\b\.?", "P.S.": r"p\.\s?s\."}.get(marker, re.escape(marker.lower()))
    starts = list(re.finditer(r"^[ \t>*_]*" + pattern, text.lower(), flags=re.MULTILINE))
    if not starts:
        return f"no line starts with the postscript marker {marker!r}"
    m = starts[-1]
    if not _has_content(text[:m.start()]):
        return "the postscript marker opens the response: there is no body before it"
    rest = text[m.end():]
    first, *later = re.split(r"\n\s*\n", rest)
    if not _has_content(first):
        return "the postscript has no content after its marker"
    if any(p.strip() and not re.match(r"[ \t>*_]*" + _PS_ANY, p.strip().lower()) for p in later):
        return "the postscript is not the final paragraph"
    return None


@strict("detectable_format:number_bullet_lists")
def _bullets(text, num_bullets):
    items = [re.sub(r"^\s*[*-]", "", b) for b in re.findall(r"^\s*\*[^\*].*$|^\s*-.*$", text, flags=re.MULTILINE)]
    return _count_problem("bullets", items, "exactly", num_bullets)


_VERDICTS = ("yes", "no", "maybe")  # the last word of each constrained option
_HEDGE_WORDS = {"or", "and", "nor", "either", "not", "perhaps", "possibly", "probably"}


def _hedges(words: list[str], chosen: str) -> bool:
    """Whether a sentence's words set two different verdicts side by side, joined by nothing
    or by hedge words ("yes or no", "yes/no", "no, maybe"), or hold nothing but hedge words and
    a verdict other than the chosen one ("Maybe not.", "Or no.")."""
    for i, w in enumerate(words):
        if w in _VERDICTS:
            j = i + 1
            while j < len(words) and words[j] in _HEDGE_WORDS:
                j += 1
            if j < len(words) and words[j] in _VERDICTS and words[j] != w:
                return True
    return set(words) <= _HEDGE_WORDS | set(_VERDICTS) and bool(set(words) & (set(_VERDICTS) - {chosen}))


@strict("detectable_format:constrained_response")
def _constrained(text):
    named = [o for o in CONSTRAINED_RESPONSES if o in text]
    if len(named) != 1:
        return f"names {len(named)} of the options (exactly one expected)"
    words = _WORD.findall(text.casefold())
    stated = sum(words[i:i + 2] == ["answer", "is"] and words[i + 2] in _VERDICTS for i in range(len(words) - 2))
    if stated != 1:  # "My answer is yes. my answer is NO" names one option exactly, but answers twice
        return f"states {stated} answers ('answer is yes/no/maybe', any case): exactly one expected"
    chosen = named[0].split()[-1].rstrip(".").lower()
    if any(_hedges(_WORD.findall(s.casefold()), chosen) for s in split_sentences(text)):
        return "hedges between the options (another verdict beside the chosen one)"
    return None


@strict("detectable_format:number_highlighted_sections")
def _highlights(text, num_highlights):
    double = [h[2:-2] for h in re.findall(r"\*\*[^\n\*]*\*\*", text)]
    single = [h[1:-1] for h in re.findall(r"\*[^\n\*]*\*", re.sub(r"\*\*[^\n\*]*\*\*", " ", text))]
    return _count_problem("highlighted sections", [h for h in double + single if h.strip()], "at least", num_highlights,
                          letters=True)


@strict("detectable_format:multiple_sections")
def _sections(text, section_spliter, num_sections):
    parts = re.split(r"\s?" + section_spliter.strip() + r"\s?\d+\s?", text)[1:]
    return _count_problem("sections", parts, "at least", num_sections)


def _json_content(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_content(k) or _json_content(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_json_content(v) for v in value)
    if isinstance(value, str):
        return _has_content(value)
    return value is not None


@strict("detectable_format:json_format")
def _json(text):
    s = text.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):  # as the reference strips them
        s = s.removeprefix(fence)
    try:
        value = json.loads(s.removesuffix("```").strip())
    except ValueError:
        return "not JSON"
    if not isinstance(value, (dict, list)):
        return f"a bare JSON {type(value).__name__}: an object or array expected"
    return None if _json_content(value) else "a JSON object or array with nothing in it"


@strict("detectable_format:title")
def _title(text):
    ok = any(_LETTER.search(t) and _meaningful(t) for t in re.findall(r"<<([^\n]+)>>", text))
    return None if ok else "no title with content"


@strict("combination:two_responses")
def _two_responses(text):
    markers = re.findall(r"\*{6,}", text)
    if markers != ["******"]:
        return (f"asterisk runs of lengths {[len(m) for m in markers][:5]}: one marker of exactly six "
                "expected between the two responses")
    answers = text.split("******")
    honest, padding = _padding(answers)
    if honest != 2 or padding:
        return "the two responses are not two different answers with content"
    first, second = ({_key(s) for s in split_sentences(a) if _meaningful(s)} for a in answers)
    if first <= second or second <= first:  # the same sentences reordered, or one answer plus more
        return "one response only repeats (or adds to) the other's sentences"
    return None


def _phrase_problem(rest: str, phrase: str, where: str) -> str | None:
    """`rest`: the text after a required opening phrase (or before a closing one, reversed)."""
    if phrase[-1:].isalnum() and rest[:1].isalnum():  # "Dear" in "Dearest": another word
        return f"the {where} phrase {phrase!r} runs on into another word"
    return None if _meaningful(rest) else f"nothing but the {where} phrase"


@strict("combination:repeat_prompt")
def _repeat_prompt(text, prompt_to_repeat):
    p, t = prompt_to_repeat.strip(), text.strip()
    if not t.startswith(p):  # the reference ignores case; "word for word without change" does not
        return "the prompt is not repeated word for word (case included)"
    rest = t[len(p):]
    if p[-1:].isalnum() and rest[:1].isalnum():
        return "the repeated prompt runs on into another word"
    asked = {_key(s) for s in split_sentences(p)}
    answer = " ".join(s for s in split_sentences(rest) if _key(s) not in asked)
    return None if _meaningful(answer) else "repeats the prompt but gives no answer (or only the prompt again)"


@strict("startend:end_checker")
def _end(text, end_phrase):
    p = end_phrase.strip()
    return _phrase_problem(text.strip().strip('"')[:-len(p)][::-1], p[::-1], "end")


@strict("startend:start_with")
def _start(text, phrase):
    return _phrase_problem(text.strip()[len(phrase.strip()):], phrase.strip(), "start")


@strict("startend:quotation")
def _quotation(text):
    return None if _has_content(text.strip()[1:-1]) else "nothing inside the quotation marks"


_CLITIC = re.compile(r"(?i)n't|'[^\W\d_]*")


def _capital_word(token: str) -> bool:
    """A word of two or more Latin letters, all capitals: not "I" or "A", not a clitic the
    tokenizer split off ("N'T" of "DON'T"), not Greek or Cyrillic capitals."""
    letters = _LETTER.findall(token)
    return (len(letters) >= 2 and token.isupper() and not _CLITIC.fullmatch(token)
            and all(c.isascii() or unicodedata.name(c, "").startswith("LATIN") for c in letters))


@strict("change_case:capital_word_frequency")
def _capital_words(text, capital_frequency, capital_relation):
    tokens = words_treebank(_honest_sentences(text))
    n = sum(_capital_word(t) for t, junk in zip(tokens, _filler(tokens)) if not junk)
    return None if RELATIONS[capital_relation](n, capital_frequency) else \
        f"{n} words of Latin capitals without filler: not {capital_relation} {capital_frequency}"


@strict("change_case:english_capital", "change_case:english_lowercase", "language:response_language")
def _language_known(text, language="en"):
    # the reference counts a text langdetect cannot classify (digits, symbols) as followed
    return None if detect_language(text) is not None else "no language can be detected in the response"


UNFOLDED = {"language:response_language"}  # folding another script into Latin lookalikes changes its language


def problem(text: str, iid: str, kwargs: dict[str, Any]) -> str | None:
    """Why strict grading rejects a response the reference check accepted (None: it doesn't)."""
    folded, kwargs = (text, kwargs) if iid in UNFOLDED else (fold(text), fold_kwargs(kwargs))
    if not _meaningful(folded):
        return "no word with content in the response"
    if folded != text and not INSTRUCTIONS[iid].check(folded, **kwargs):
        return "fails once lookalike or invisible characters are folded"
    check = STRICT.get(iid)
    return check(folded, **kwargs) if check else None
