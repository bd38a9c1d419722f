"""Text as a reader sees it, for IFEval's strict grading (``ifeval_strict.py``): lookalike
characters folded to what they imitate (Unicode's confusables, letter names, every mark
that reads as a comma), invisible characters and combining marks removed; and an
instruction's own words and phrases folded the same way, so that they still match.
"""
from __future__ import annotations

import functools
import re
import unicodedata
from typing import Any

# punctuation and symbols a reader takes for a comma: named so, or low marks of that shape
_COMMA_NAME = re.compile(r"COMMA|DECIMAL SEPARATOR|THOUSANDS SEPARATOR|LOW ACUTE|LOW GRAVE|^OGONEK$")
_LATIN_NAME = re.compile(r"LATIN (SMALL LETTER|CAPITAL LETTER|LETTER SMALL CAPITAL) ([A-Z])(?: WITH .*)?")


@functools.cache
def _fold_table() -> dict[int, str | None]:
    """Non-ASCII character -> what it imitates: an ASCII character it is confusable with
    (Unicode's confusables data), a Latin letter by its name (small capitals as capitals,
    letters with hooks or strokes), a comma (punctuation and symbols named COMMA, decimal
    and thousands separators, low accents of a comma's shape), or nothing (format
    characters: zero-width spaces and joiners, soft hyphen, bidi controls, tags)."""
    from confusable_homoglyphs.confusables import confusables_data

    table: dict[int, str | None] = {}
    for cp in (*range(0x80, 0x20000), *range(0xE0000, 0xE1000)):  # the planes with format characters and commas
        ch = chr(cp)
        cat, name = unicodedata.category(ch), unicodedata.name(ch, "")
        if cat == "Cf":
            table[cp] = None
        elif (cat[0] in "PS" or cat == "Lm") and _COMMA_NAME.search(name):
            table[cp] = ","
        elif m := _LATIN_NAME.fullmatch(name):
            table[cp] = m.group(2).lower() if m.group(1) == "SMALL LETTER" else m.group(2)  # small capitals look capital
    for ch, glyphs in confusables_data.items():
        if len(ch) == 1 and not ch.isascii() and ord(ch) not in table:
            targets = [g["c"] for g in glyphs if len(g["c"]) == 1 and g["c"].isascii() and g["c"].isprintable()
                       and not g["c"].isspace()]
            if targets:
                table[ord(ch)] = ([t for t in targets if t.isalnum()] or targets)[0]
    return table


def fold(text: str) -> str:
    """The text as a reader sees it: lookalikes folded to what they imitate, invisible
    characters and combining marks (accents, underlines, joiners) removed."""
    if text.isascii():
        return text
    table = _fold_table()
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text.translate(table)))
    return unicodedata.normalize("NFC", "".join(c for c in text if unicodedata.category(c) != "Mn")).translate(table)


def fold_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The instruction's phrases and words folded as the text is: an accented keyword or
    prompt ("café") still matches its honest use in the folded text."""
    def one(v):
        return fold(v) if isinstance(v, str) else v
    return {k: [one(x) for x in v] if isinstance(v, list) else one(v) for k, v in kwargs.items()}
