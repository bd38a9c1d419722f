"""Low-quality filter: invisible/control characters, lossy decoding, mojibake, foreign
scripts, length, repeated lines. Cleanable rows are cleaned, hopeless ones removed.

Cleaned in place (every message / field of the row, so the written row changes):
- C0/C1 control characters (not tab/newline/CR), zero-width spaces, word joiners, BOMs,
  soft hyphens, invisible math operators, bidi marks/embeddings/overrides/isolates,
  private-use characters, noncharacters, lone surrogates, tag characters (kept inside
  emoji flag sequences), zero-width (non-)joiners next to Latin/Greek/Cyrillic text
  (kept between characters of scripts that use them: emoji, Indic, Arabic);
- U+FFFD replacement characters, up to `max_replacement_chars` per row;
- mojibake (UTF-8 read as cp1252/Latin-1, e.g. "cafÃ©" -> "café") when it decodes back.
Removed, with the reason: more invisible characters than `max_invisible_ratio` of the
text, more replacement characters than allowed, mojibake that does not decode back,
too many letters outside the row's main script and `allowed_scripts`, too short / too
long, no response, too many repeated lines.
"""
from __future__ import annotations

import bisect
import json
import re
from typing import Any, Literal

import numpy as np
from pydantic import Field

from data_curation._base import bump
from data_curation.row_schema import FieldMap, dump_row, extract, map_texts
from data_curation.step_api import Decision, RunContext, StepConfig, StepRunner

_INVISIBLE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b\u200e\u200f\u202a-\u202e"
    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\ufdd0-\ufdef\ufffe\uffff\ue000-\uf8ff"
    "\ud800-\udfff\U000f0000-\U000ffffd\U00100000-\U0010fffd\U000e0001]")
_ASCII_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# a zero-width (non-)joiner with a Latin/Greek/Cyrillic/ASCII char, space or text edge
# on either side
_JOINER = re.compile("(?<![^\x00-\u052f\\s])[\u200c\u200d]+|[\u200c\u200d]+(?![^\x00-\u052f\\s])")
_TAGS = re.compile("(\U0001F3F4[\U000E0020-\U000E007F]+)|[\U000E0020-\U000E007F]+")
_CP1252_HIGH = "€‚ƒ„…†‡ˆ‰Š‹ŒŽ‘’“”•–—˜™š›œžŸ"
_CONT = "[\x80-\xbf" + _CP1252_HIGH + "]"
_MOJIBAKE = re.compile(f"[\xc2-\xdf]{_CONT}|[\xe0-\xef]{_CONT}{{2}}|[\xf0-\xf4]{_CONT}{{3}}")
_CP1252_BYTE = {c: c.encode("cp1252")[0] for c in _CP1252_HIGH}
_ASCII_LETTERS = re.compile("[A-Za-z]")
_NON_ASCII = re.compile("[^\x00-\x7f]")

# (first code point, script) of contiguous ranges; letters elsewhere are "Other"
_SCRIPT_RANGES = sorted([
    (0x0041, "Latin"), (0x005B, None), (0x0061, "Latin"), (0x007B, None), (0x00C0, "Latin"),
    (0x0250, "Latin"), (0x02B0, None), (0x0370, "Greek"), (0x0400, "Cyrillic"),
    (0x0530, "Armenian"), (0x0590, "Hebrew"), (0x0600, "Arabic"), (0x0700, "Syriac"),
    (0x0750, "Arabic"), (0x0780, "Thaana"), (0x07C0, None), (0x08A0, "Arabic"),
    (0x0900, "Indic"), (0x0E00, "Thai"), (0x0E80, "Lao"), (0x0F00, "Tibetan"),
    (0x1000, "Myanmar"), (0x10A0, "Georgian"), (0x1100, "Hangul"), (0x1200, "Ethiopic"),
    (0x13A0, None), (0x1780, "Khmer"), (0x1800, "Mongolian"), (0x18B0, None),
    (0x1E00, "Latin"), (0x1F00, "Greek"), (0x2000, None), (0x2C00, None), (0x2C60, "Latin"),
    (0x2C80, None), (0x2D00, "Georgian"), (0x2D30, None), (0x2DE0, "Cyrillic"),
    (0x2E00, None), (0x2E80, "Han"), (0x2FE0, None), (0x3040, "Kana"), (0x3100, "Han"),
    (0x3130, "Hangul"), (0x3190, "Han"), (0x31F0, "Kana"), (0x3200, "Han"),
    (0xA000, "Yi"), (0xA4D0, None), (0xA640, "Cyrillic"), (0xA6A0, None), (0xA720, "Latin"),
    (0xA800, None), (0xAC00, "Hangul"), (0xD7B0, None), (0xF900, "Han"), (0xFB00, "Latin"),
    (0xFB07, None), (0xFB1D, "Hebrew"), (0xFB50, "Arabic"), (0xFE00, None), (0xFE70, "Arabic"),
    (0xFF00, None), (0xFF21, "Latin"), (0xFF3B, None), (0xFF41, "Latin"), (0xFF5B, None),
    (0xFF66, "Kana"), (0xFFA0, "Hangul"), (0xFFE0, None), (0x20000, "Han"), (0x32000, None),
])
_SCRIPT_STARTS = [s for s, _ in _SCRIPT_RANGES]
# scripts that are written together: one family counts as one script
_FAMILY = {"Kana": "Han", "Hangul": "Han"}


def script_of(ch: str) -> str:
    i = bisect.bisect_right(_SCRIPT_STARTS, ord(ch)) - 1
    s = _SCRIPT_RANGES[i][1] if i >= 0 else None
    return _FAMILY.get(s, s) if s else "Other"


class QualityConfig(StepConfig):
    step: Literal["quality"] = "quality"
    invisible: Literal["clean", "remove_row", "ignore"] = "clean"
    max_invisible_ratio: float = Field(0.2, ge=0, le=1, description="rows with more invisible "
                                       "characters than this fraction of their text are removed")
    replacement_chars: Literal["clean", "remove_row", "ignore"] = "clean"
    max_replacement_chars: int = Field(3, ge=0, description="more U+FFFD than this: removed")
    mojibake: Literal["repair", "remove_row", "ignore"] = "repair"
    max_unrepaired_mojibake: int = Field(2, ge=0)
    allowed_scripts: list[str] = Field(["Latin", "Greek"], description="scripts always "
                                       "allowed besides the row's dominant one (Han covers Kana/Hangul)")
    max_extraneous_script_ratio: float = Field(0.3, ge=0, le=1)
    min_chars: int = Field(10, ge=0, description="prompt + response characters")
    max_chars: int = Field(2_000_000, ge=1)
    require_response: bool = Field(True, description="rows need a non-empty response (assistant "
                                   "turns / response field / text)")
    max_repeated_line_ratio: float = Field(0.3, ge=0, le=1)
    min_lines_for_repetition: int = Field(6, ge=2)
    max_examples: int = Field(5, ge=0)

    def build(self, ctx: RunContext) -> "QualityFilter":
        return QualityFilter(self, ctx.fields)


class QualityFilter(StepRunner):
    mode = "rows"

    def __init__(self, cfg: QualityConfig, fields: FieldMap):
        self.cfg = cfg
        self.fields = fields

    # -- cleaning --------------------------------------------------------------------
    @staticmethod
    def _repair_mojibake(text: str) -> tuple[str, int, int]:
        repaired = failed = 0

        def fix(m: re.Match) -> str:
            nonlocal repaired, failed
            seg = m.group(0)
            try:
                out = bytes(ord(c) if ord(c) < 256 else _CP1252_BYTE[c] for c in seg).decode("utf-8")
            except (UnicodeDecodeError, KeyError):
                failed += 1
                return seg
            repaired += 1
            return out

        return _MOJIBAKE.sub(fix, text), repaired, failed

    def clean(self, text: str, found: dict[str, int]) -> str:
        """The text with cleanable problems fixed; counts what it did into `found`."""
        c = self.cfg
        if text.isascii():
            if c.invisible != "ignore":
                new = _ASCII_CONTROLS.sub("", text)
                if len(new) != len(text):
                    bump(found, "invisible_characters", len(text) - len(new))
                return new
            return text
        if c.invisible != "ignore":
            n0 = len(text)
            text = _INVISIBLE.sub("", text)
            text = _JOINER.sub("", text)
            text = _TAGS.sub(lambda m: m.group(1) or "", text)
            if len(text) != n0:
                bump(found, "invisible_characters", n0 - len(text))
        if c.replacement_chars != "ignore" and "\ufffd" in text:
            bump(found, "replacement_characters", text.count("\ufffd"))
            text = text.replace("\ufffd", "")
        if c.mojibake != "ignore":
            text, rep, failed = self._repair_mojibake(text)
            if rep:
                bump(found, "mojibake_repaired", rep)
            if failed:
                bump(found, "mojibake_unrepaired", failed)
        return text

    # -- checks ----------------------------------------------------------------------
    def extraneous_script_ratio(self, text: str) -> tuple[float, str]:
        counts: dict[str, int] = {"Latin": len(_ASCII_LETTERS.findall(text))}
        for ch in _NON_ASCII.findall(text):
            if ch.isalpha():
                s = script_of(ch)
                counts[s] = counts.get(s, 0) + 1
        total = sum(counts.values())
        if not total:
            return 0.0, "none"
        dominant = max(counts, key=counts.get)
        allowed = set(self.cfg.allowed_scripts) | {dominant}
        extra = sum(n for s, n in counts.items() if s not in allowed)
        return extra / total, dominant

    def repeated_line_ratio(self, text: str) -> float:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if len(lines) < self.cfg.min_lines_for_repetition:
            return 0.0
        return 1 - len(set(lines)) / len(lines)

    def judge(self, prompt: str, response: str) -> tuple[str, dict] | None:
        c = self.cfg
        n = len(prompt) + len(response)
        if n < c.min_chars:
            return "too_short", {"chars": n, "min_chars": c.min_chars}
        if n > c.max_chars:
            return "too_long", {"chars": n, "max_chars": c.max_chars}
        if c.require_response and not response.strip():
            return "empty_response", {}
        text = f"{prompt}\n{response}"
        if not text.isascii():
            ratio, dominant = self.extraneous_script_ratio(text)
            if ratio > c.max_extraneous_script_ratio:
                return "extraneous_script", {"ratio": round(ratio, 4), "dominant": dominant}
        for part, t in (("prompt", prompt), ("response", response)):
            r = self.repeated_line_ratio(t)
            if r > c.max_repeated_line_ratio:
                return "repeated_lines", {"field": part, "ratio": round(r, 4)}
        return None

    def process(self, table) -> Decision:
        c, fm = self.cfg, self.fields
        n = table.num_rows
        raws = table.column("_raw").to_pylist()
        prompts = table.column("_prompt").to_pylist()
        responses = table.column("_response").to_pylist()
        rows = table.column("_row").to_pylist()
        keep = np.ones(n, dtype=bool)
        reasons: list[str | None] = [None] * n
        details: list[dict | None] = [None] * n
        new_raw, new_p, new_r = list(raws), list(prompts), list(responses)
        changed = False
        stats: dict[str, Any] = {"cleaned_rows": {}, "cleaned_chars": {}, "removed": {},
                                 "examples_cleaned": [], "examples_removed": []}
        for i in range(n):
            p, r = prompts[i], responses[i]
            found: dict[str, int] = {}
            p2, r2 = self.clean(p, found), self.clean(r, found)
            verdict = None
            total = max(1, len(p) + len(r))
            inv = found.get("invisible_characters", 0)
            if inv and (c.invisible == "remove_row" or inv / total > c.max_invisible_ratio):
                verdict = ("invisible_characters", {"count": inv, "ratio": round(inv / total, 4)})
            rep = found.get("replacement_characters", 0)
            if verdict is None and rep and (c.replacement_chars == "remove_row"
                                            or rep > c.max_replacement_chars):
                verdict = ("replacement_characters", {"count": rep})
            bad = found.get("mojibake_unrepaired", 0)
            moj = found.get("mojibake_repaired", 0)
            if verdict is None and ((moj and c.mojibake == "remove_row")
                                    or bad > c.max_unrepaired_mojibake):
                verdict = ("mojibake", {"repaired": moj, "unrepaired": bad})
            if verdict is None:
                verdict = self.judge(p2, r2)
            if verdict is not None:
                keep[i] = False
                reasons[i], details[i] = verdict
                bump(stats["removed"], verdict[0])
                if len(stats["examples_removed"]) < c.max_examples:
                    stats["examples_removed"].append({"row": rows[i], "reason": verdict[0],
                                                      **verdict[1]})
                continue
            cleaned = {k: v for k, v in found.items() if k != "mojibake_unrepaired"}
            if cleaned:
                obj = json.loads(raws[i])
                map_texts(obj, fm, lambda t, _part: self.clean(t, {}))
                text = extract(obj, fm)
                new_p[i], new_r[i] = text.prompt, text.response
                new_raw[i] = dump_row(obj)
                changed = True
                for k, v in cleaned.items():
                    bump(stats["cleaned_rows"], k)
                    bump(stats["cleaned_chars"], k, v)
                if len(stats["examples_cleaned"]) < c.max_examples:
                    stats["examples_cleaned"].append({"row": rows[i], **cleaned})
        cols = {"_raw": new_raw, "_prompt": new_p, "_response": new_r} if changed else {}
        return Decision(keep, reasons, details, cols, stats)

    def summarize(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {**stats, "examples_cleaned": stats.get("examples_cleaned", [])[: self.cfg.max_examples],
                "examples_removed": stats.get("examples_removed", [])[: self.cfg.max_examples]}
