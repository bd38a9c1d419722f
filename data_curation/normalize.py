"""Normalisation for matching: what dedup and decontamination compare, never what is written.

A matching key is a token sequence: Unicode-normalised (NFKC: full-width digits become
ASCII, NBSP becomes a space, ligatures split), invisible format characters removed
(zero-width joiners inside words, bidi overrides, BOMs, private-use), confusable
characters folded to the ASCII letter or digit they imitate (Unicode's confusables data,
UTS #39, through `confusable_homoglyphs`: Cyrillic `а`/`е`/`і`, Greek `Ο`, ... become
`a`/`e`/`i`/`O`), apostrophes inside words dropped (`brown's` = `browns`, so a copy that
drops them keeps its tokens), case-folded, LaTeX presentation noise folded (`\\dfrac` =
`\\frac`, `\\left(` = `(`, `\\,` = space), then split into runs of letters/digits. Punctuation is a
separator ("remove", the default),
or kept as single-character tokens after folding Unicode variants to ASCII ("fold") or
as is ("keep"). Digits are kept, mapped to 0, or dropped. The normalised text is the
tokens joined by single spaces. The rows written out are never touched by this module.
"""
from __future__ import annotations

import functools
import re
import unicodedata
from typing import Literal

from data_curation._base import Strict


class NormalizeConfig(Strict):
    unicode_form: Literal["NFKC", "NFC", "none"] = "NFKC"
    casefold: bool = True
    strip_invisible: bool = True
    latex: bool = True
    confusables: bool = True
    join_apostrophes: bool = True
    punctuation: Literal["remove", "fold", "keep"] = "remove"
    digits: Literal["keep", "zero", "remove"] = "keep"


# Every format (Cf), surrogate (Cs) and private-use (Co) code point of the Unicode
# database (tests/curation checks this table against `unicodedata`): zero-width spaces and
# joiners, bidi embeddings/overrides/isolates, BOM, soft hyphen, tag characters, ...
INVISIBLE_RANGES: tuple[tuple[int, int], ...] = (
    (0xAD, 0xAD), (0x600, 0x605), (0x61C, 0x61C), (0x6DD, 0x6DD), (0x70F, 0x70F),
    (0x890, 0x891), (0x8E2, 0x8E2), (0x180E, 0x180E), (0x200B, 0x200F), (0x202A, 0x202E),
    (0x2060, 0x2064), (0x2066, 0x206F), (0xD800, 0xF8FF), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x1343F), (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A), (0xE0001, 0xE0001), (0xE0020, 0xE007F), (0xF0000, 0xFFFFD),
    (0x100000, 0x10FFFD),
)


def char_class(ranges) -> str:
    def esc(cp: int) -> str:
        return f"\\U{cp:08x}"

    return "[" + "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges) + "]"


@functools.cache
def invisible_re() -> re.Pattern:
    return re.compile(char_class(INVISIBLE_RANGES))


_C1_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")

_LATEX_SUBS = [
    (re.compile(r"\\[dt]frac(?![a-z])"), r"\\frac"),
    (re.compile(r"\\(?:left|right|bigl|bigr|bigg|biggl|biggr|big|displaystyle|textstyle|"
                r"limits|nolimits|quad|qquad)(?![a-z])"), " "),
    (re.compile(r"\\[,;:! ]"), " "),
    (re.compile(r"\\(?:text|mathrm|mathbf|mathit|textbf|textit|operatorname|mbox)\s*\{"), "{"),
    # a command name ends at its last letter: `\cdot3` is `\cdot 3`
    (re.compile(r"(\\[a-z]+)(?=[0-9])"), r"\1 "),
]

# Unicode punctuation variants -> ASCII (used by punctuation="fold"; NFKC does the full-width ones)
_PUNCT_FOLD = str.maketrans({
    **{c: "'" for c in "\u2018\u2019\u201a\u201b\u2032\u02bc\u0060\u00b4"},
    **{c: '"' for c in "\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb\u2039\u203a"},
    **{c: "-" for c in "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\u2043\ufe63"},
    "\u2026": "...", "\u00d7": "*", "\u00f7": "/", "\u2022": "*", "\u00b7": "*",
})

# an apostrophe (or a character used as one) between two letters/digits
_APOSTROPHE = re.compile("(?<=\\w)['`\u00b4\u2018\u2019\u02bc\u2032](?=\\w)")
_APOSTROPHE_CHARS = "'`\u00b4\u2018\u2019\u02bc\u2032"


@functools.cache
def confusables_table() -> dict[int, str]:
    """Non-ASCII character -> the ASCII letter (else digit) it is confusable with, from
    Unicode's confusables data; characters confusable with no single ASCII letter or digit
    are left alone."""
    from confusable_homoglyphs.confusables import confusables_data

    out: dict[int, str] = {}
    for ch, glyphs in confusables_data.items():
        if len(ch) != 1 or ch.isascii():
            continue
        targets = [g["c"] for g in glyphs if len(g["c"]) == 1 and g["c"].isascii() and g["c"].isalnum()]
        letters = [t for t in targets if t.isalpha()]
        if targets:
            out[ord(ch)] = (letters or targets)[0]
    return out


_DIGIT = re.compile(r"\d")
_DIGITS = re.compile(r"\d+")
_WORDS = re.compile(r"[^\W_]+")
_WORDS_AND_PUNCT = re.compile(r"[^\W_]+|[^\w\s]")


class Normalizer:
    """Turns text into matching tokens; one instance per config (compiled once)."""

    def __init__(self, cfg: NormalizeConfig | None = None):
        self.cfg = cfg or NormalizeConfig()
        self._tok = _WORDS if self.cfg.punctuation == "remove" else _WORDS_AND_PUNCT
        # built here, before a step's workers fork, so that they share it
        self._confusables = confusables_table() if self.cfg.confusables else None

    def prepare(self, text: str) -> str:
        """The normalised string before tokenisation (punctuation still present)."""
        c = self.cfg
        ascii_only = text.isascii()
        if not ascii_only:
            if c.strip_invisible:
                text = invisible_re().sub("", text)
            if c.unicode_form != "none":
                text = unicodedata.normalize(c.unicode_form, text)
            if self._confusables is not None:
                text = text.translate(self._confusables)
        # substring tests first: a regex pass over every text costs more than these
        if c.join_apostrophes and (("'" in text or "`" in text) if ascii_only
                                   else any(ch in text for ch in _APOSTROPHE_CHARS)):
            text = _APOSTROPHE.sub("", text)
        if c.punctuation != "remove":
            text = _C1_CONTROLS.sub(" ", text)
            if c.punctuation == "fold" and not ascii_only:
                text = text.translate(_PUNCT_FOLD)
        if c.casefold:
            text = text.casefold()
        if c.latex and "\\" in text:
            for pattern, repl in _LATEX_SUBS:
                text = pattern.sub(repl, text)
        if c.digits == "zero":
            text = _DIGIT.sub("0", text)
        elif c.digits == "remove":
            text = _DIGITS.sub(" ", text)
        return text

    def tokens(self, text: str) -> list[str]:
        return self._tok.findall(self.prepare(text))

    def text(self, text: str) -> str:
        return " ".join(self.tokens(text))
