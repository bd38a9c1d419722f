"""Which sampled responses become SFT chats, and the report of what happened to them.
Pure Python: the rules and their tests need no model.

Each response of a prompt gets one verdict, checked in this order:
- `rejected`: the verifier's score is below `min_score`;
- `truncated`: cut at max_new_tokens (no EOS), when `require_eos`;
- `too_short` / `too_long`: fewer than `min_tokens` / more than `max_tokens` tokens;
- `duplicate`: its normalised text (NFKC, case-folded, whitespace collapsed) equals that of a
  response of the same prompt kept before it;
- `over_limit`: the prompt already has `max_per_prompt` kept responses;
- `kept`: the rest (in sample order). `accepted` = every verdict but `rejected`.

The report counts per task family (a row's `family_field`, else its domain), per domain and
overall: prompts sampled, prompts skipped (longer than prompt_max_len), samples, accepted,
acceptance rate (accepted / samples), kept chats, prompts with a kept chat, and each verdict.
"""
from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from typing import Any, Protocol

VERDICTS = ("kept", "rejected", "truncated", "too_short", "too_long", "duplicate", "over_limit")
ALL = "all"


class Rules(Protocol):
    min_score: float
    require_eos: bool
    min_tokens: int
    longest: int
    max_per_prompt: int


def normalise(text: str) -> str:
    """What two responses must share to count as the same one."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def verdicts(samples: list[dict[str, Any]], rules: Rules) -> list[str]:
    """The verdict of each response of ONE prompt (`score`, `ended_by_eos`, `tokens`, `response`)."""
    out, seen = [], set()
    for s in samples:
        key = normalise(s["response"])
        if s["score"] < rules.min_score:
            v = "rejected"
        elif rules.require_eos and not s["ended_by_eos"]:
            v = "truncated"
        elif s["tokens"] < rules.min_tokens:
            v = "too_short"
        elif s["tokens"] > rules.longest:
            v = "too_long"
        elif key in seen:
            v = "duplicate"
        elif len(seen) >= rules.max_per_prompt:
            v = "over_limit"
        else:
            v = "kept"
            seen.add(key)
        out.append(v)
    return out


def _empty() -> dict[str, float]:
    return {"prompts": 0, "prompts_skipped": 0, "samples": 0, "accepted": 0, "acceptance_rate": 0.0,
            "kept": 0, "prompts_with_kept": 0, **{f"verdict_{v}": 0 for v in VERDICTS}}


def report(records: Iterable[dict[str, Any]], skipped: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """{"families": {family: counts}, "domains": {domain: counts}, "overall": counts} from every
    sample's record (`prompt` index, `family`, `domain`, `verdict`) and the skipped prompts
    (`family`, `domain`)."""
    tables: dict[str, dict[str, dict[str, float]]] = {"families": {}, "domains": {}}

    def cells(r: dict[str, Any]) -> list[dict[str, float]]:
        return [tables["families"].setdefault(r["family"], _empty()),
                tables["domains"].setdefault(r["domain"], _empty()), overall]

    overall = _empty()
    prompts_seen: dict[int, bool] = {}  # prompt index -> has a kept chat
    for r in records:
        first = r["prompt"] not in prompts_seen
        kept = r["verdict"] == "kept"
        newly_kept = kept and not prompts_seen.get(r["prompt"], False)
        prompts_seen[r["prompt"]] = prompts_seen.get(r["prompt"], False) or kept
        for c in cells(r):
            c["prompts"] += first
            c["prompts_with_kept"] += newly_kept
            c["samples"] += 1
            c["accepted"] += r["verdict"] != "rejected"
            c["kept"] += kept
            c[f"verdict_{r['verdict']}"] += 1
    for r in skipped:
        for c in cells(r):
            c["prompts_skipped"] += 1
    for c in [*tables["families"].values(), *tables["domains"].values(), overall]:
        c["acceptance_rate"] = c["accepted"] / c["samples"] if c["samples"] else 0.0
    return {"families": dict(sorted(tables["families"].items())),
            "domains": dict(sorted(tables["domains"].items())), "overall": overall}


def describe_rates(rep: dict[str, Any]) -> str:
    """One line: each family's accepted / samples (rate) and kept chats."""
    return "; ".join(f"{name} {c['accepted']}/{c['samples']} accepted ({c['acceptance_rate']:.1%}), "
                     f"{c['kept']} kept" + (f", {c['prompts_skipped']} prompts skipped as too long"
                                            if c["prompts_skipped"] else "")
                     for name, c in rep["families"].items())
