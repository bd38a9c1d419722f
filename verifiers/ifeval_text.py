"""The text units IFEval's checks count: sentences (the reference's rule-based splitter),
Treebank word tokens (what ``nltk.word_tokenize`` yields, for counting all-capital words),
and the response's language (``langdetect``).

The reference tokenizes words with ``nltk.word_tokenize``: NLTK's Punkt model splits the
text into sentences, then NLTK's Treebank-style word tokenizer splits each sentence. Punkt's
English model comes with no PyPI package, so ``words_treebank`` splits sentences with
``split_sentences`` (the reference's own rule-based splitter, which the sentence count uses
too) and re-implements the word tokenizer's splits: which characters stand apart, which
endings are clitics (``DON'T`` -> ``DO`` ``N'T``) and which words are two (``CANNOT``,
``GONNA``). Every rule is one left-to-right regex pass with bounded lookaround: linear in the
text.
"""
from __future__ import annotations

import re

_SITE_RE = re.compile(r"[.](com|net|org|io|gov|edu|me)")
_STARTERS = (r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s|However\s|That\s"
             r"|This\s|Wherever)")
_SUFFIXES = "(Inc|Ltd|Jr|Sr|Co)"
DOT, STOP = "\x00", "\x01"  # a protected period; a sentence boundary


def split_sentences(text: str) -> list[str]:
    """Rule-based sentence split (the reference's ``split_into_sentences`` rules): periods in
    titles, initials, acronyms, decimals and web addresses do not end a sentence; an
    ellipsis does; closing quotes stay with their sentence."""
    t = " " + text.replace("\n", " ") + "  "
    t = re.sub(r"(Mr|St|Mrs|Ms|Dr)[.]", r"\1" + DOT, t)
    t = _SITE_RE.sub(DOT + r"\1", t)
    t = re.sub(r"([0-9])[.]([0-9])", r"\1" + DOT + r"\2", t)
    t = re.sub(r"\.{2,}", lambda m: DOT * len(m.group(0)) + STOP, t)
    t = t.replace("Ph.D.", "Ph" + DOT + "D" + DOT)
    t = re.sub(r"\s([A-Za-z])[.] ", r" \1" + DOT + " ", t)
    t = re.sub(r"([A-Z][.][A-Z][.](?:[A-Z][.])?) " + _STARTERS, lambda m: m.group(1) + STOP + " " + m.group(2), t)
    t = re.sub(r"([A-Za-z])[.]([A-Za-z])[.]([A-Za-z])[.]", r"\1" + DOT + r"\2" + DOT + r"\3" + DOT, t)
    t = re.sub(r"([A-Za-z])[.]([A-Za-z])[.]", r"\1" + DOT + r"\2" + DOT, t)
    t = re.sub(" " + _SUFFIXES + "[.] " + _STARTERS, " \\1" + STOP + " \\2", t)
    t = re.sub(" " + _SUFFIXES + "[.]", " \\1" + DOT, t)
    t = re.sub(" ([A-Za-z])[.]", " \\1" + DOT, t)
    for closing in ("”", '"'):
        t = t.replace("." + closing, closing + ".")
    t = t.replace('!"', '"!').replace('?"', '"?')
    for mark in ".?!":
        t = t.replace(mark, mark + STOP)
    parts = [p.replace(DOT, ".").strip() for p in t.split(STOP)]
    return parts[:-1] if parts and not parts[-1] else parts


# What the Treebank tokenizer sets apart, in its order (the order decides which apostrophes
# end a word, and so which clitics split): opening quotes; a colon or comma unless a digit
# follows it ("3,36" and "10:30" stay whole), runs of periods, ; @ # $ % & ? ! and figure/en/em
# dashes; an apostrophe that ends a word; asterisks; brackets and double hyphens; closing
# quotes. A single hyphen, slash, apostrophe or inner period joins ("WELL-KNOWN", "AND/OR").
_OPENING = re.compile(r"[«“‘„]|`+")
_OPENING_QUOTE = re.compile(r"(?i)(?<!\w)'(?!(?:re|ve|ll|m|t|s|d|n)\b)(?=\w)")  # not a clitic ('s, 're, ...)
_PUNCTUATION = re.compile(r"[:,](?!\d)|\.{2,}|[;@#$%&?!\u2012-\u2015]")
_WORD_END_QUOTE = re.compile(r"(?<=[^'])'(?= )")
_BRACKETS = re.compile(r"[*]|[\[\](){}<>]|--")
_CLOSING = re.compile(r"""[»”’"]|''""")
_CLOSERS = "])}>\"'»”’ "  # what may follow a sentence's final period
# clitics split off a word when a space follows them, in the tokenizer's two passes
_CLITICS_1 = re.compile(r"(?<=[^' ])('[sSmMdD]|')(?= )")
_CLITICS_2 = re.compile(r"(?<=[^' ])('ll|'LL|'re|'RE|'ve|'VE|n't|N'T)(?= )")
# words the tokenizer reads as two, set apart from what they touch too: CANNOT -> CAN NOT,
# GONNA -> GON NA, D'YE -> D 'YE, ...; then a 'TIS or 'TWAS that a space now opens -> 'T IS
_TWO_WORDS = re.compile(r"(?i)\b(?:(can)(not)|(d)('ye)|(gim)(me)|(gon)(na)|(got)(ta)|(lem)(me)|(more)('n))\b"
                        r"|\b(wan)(na)(?=\s)")
_T_IS = re.compile(r"(?i)(?<= )('t)(?=(?:is|was)\b)")


def _two_words(m: re.Match) -> str:
    return " " + " ".join(g for g in m.groups() if g) + " "


def _final_period_apart(sentence: str) -> str:
    """The sentence with its final period (before closing brackets and quotes) set apart,
    unless it ends a run of periods."""
    s = sentence.rstrip()
    i = len(s)
    while i and s[i - 1] in _CLOSERS:
        i -= 1
    if i >= 2 and s[i - 1] == "." and s[i - 2] != ".":
        return s[:i - 1] + " . " + s[i:]
    return s


def treebank_tokens(sentence: str) -> list[str]:
    """The Treebank-style tokens of one sentence: punctuation apart, clitics split
    (DON'T -> DO N'T), hyphenated and slashed words whole."""
    t = _OPENING_QUOTE.sub("' ", _OPENING.sub(r" \g<0> ", sentence))
    t = _PUNCTUATION.sub(r" \g<0> ", _final_period_apart(t))
    t = _BRACKETS.sub(r" \g<0> ", _WORD_END_QUOTE.sub(" ' ", t))
    t = re.sub(r"\s+", " ", _CLOSING.sub(r" \g<0> ", " " + t + " "))
    t = _CLITICS_2.sub(r" \1", _CLITICS_1.sub(r" \1", t))
    return _T_IS.sub(r"\1 ", _TWO_WORDS.sub(_two_words, t)).split()


def words_treebank(text: str) -> list[str]:
    """What ``nltk.word_tokenize`` yields, with ``split_sentences`` for Punkt's sentences."""
    return [tok for s in split_sentences(text) for tok in treebank_tokens(s)]


def detect_language(text: str) -> str | None:
    """ISO code, or None where langdetect has nothing to go on."""
    import langdetect

    langdetect.DetectorFactory.seed = 0
    try:
        return langdetect.detect(text)
    except langdetect.LangDetectException:
        return None
