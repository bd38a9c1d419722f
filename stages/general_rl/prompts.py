"""General-RL prompts: per-source files -> prompt rows; the held-out reasoning set's rows.

A prompt row (jsonl/json/parquet, read by stages/common/rows.py; other fields are ignored) is
one of:
- `prompt`: a string (one user turn) or a list of {role, content} messages; optional
  `domain` + `reference` make it rule-checked by that verifier (e.g. domain "ifeval",
  reference {"instructions": [...]}, or domain "math", reference {"answer": ...});
- `messages`: a chat; the prompt is everything up to its last user turn (Magpie /
  ShareGPT style rows with the answer included);
- `instruction`: a string (Magpie style);
- a preference pair (prompt/chosen/rejected or an arena row with `winner`; see
  stages/reward_model/data.py): its prompt is used, the replies are not.
A row without any of these, with a `reference` but no `domain`, or with a domain no verifier
knows while it has a reference, stops the stage with file, row and reason. Preference rows
the reward-model rules would quarantine are skipped and counted.

Each kept row becomes {"id": "<source>/<row id or line>", "source", "messages",
"prompt" (the last user turn's text, what verifiers read), "domain", "reference"}; ids are
made unique per source. Rows whose rendered prompt exceeds `prompt_max_len` tokens are
skipped and counted (stages/rl/prompts.py).
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from stages.common.rows import DataError, input_rows
from stages.reward_model.data import PairProblem, normalise_row

WHAT = "general_rl data"


class PromptDataError(DataError):
    """Bad prompt data: the message names the file, the row and the reason."""


def _chat(value: Any, where: str, name: str) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise PromptDataError(f"{where}: `{name}` is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise PromptDataError(f"{where}: `{name}` must be a string or a non-empty list of messages")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptDataError(f"{where}: `{name}[{j}]` must be {{role: str, content: str}}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def prompt_row(row: Any, where: str, known_domains: set[str]) -> dict[str, Any] | None:
    """A prompt row -> {messages, prompt, domain, reference}; None for a preference row that
    the reward-model rules reject (the caller counts it)."""
    if not isinstance(row, dict):
        raise PromptDataError(f"{where}: a row must be a JSON object")
    row = {k: v for k, v in row.items() if v is not None}  # `datasets` fills absent columns with None
    if any(k in row for k in ("chosen", "rejected", "winner", "winner_model_a", "conversation_a")):
        try:
            pair = normalise_row(row, where, 0, strip=False)
        except PairProblem:
            return None
        msgs = pair.prompt
    elif row.get("prompt") is not None:
        msgs = _chat(row["prompt"], where, "prompt")
    elif row.get("messages") is not None:
        msgs = _chat(row["messages"], where, "messages")
    elif row.get("instruction") is not None:
        msgs = _chat(row["instruction"], where, "instruction")
    else:
        raise PromptDataError(f"{where}: no prompt (expected `prompt`, `messages`, `instruction` "
                              "or a preference pair)")
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last_user is None:
        raise PromptDataError(f"{where}: the prompt has no user turn")
    msgs = msgs[:last_user + 1]
    if not msgs[-1]["content"].strip():
        raise PromptDataError(f"{where}: the last user turn is empty")
    domain, reference = row.get("domain"), row.get("reference")
    if reference is not None:
        if not isinstance(domain, str) or not domain:
            raise PromptDataError(f"{where}: the row has a `reference` but no `domain` (which verifier "
                                  "checks it?)")
        if domain not in known_domains:
            raise PromptDataError(f"{where}: domain {domain!r} has no verifier (known: {sorted(known_domains)}); "
                                  "drop its `reference` to have it judged by the reward model alone")
    out = {k: v for k, v in row.items() if k in ("extraction",)}
    out.update({"messages": msgs, "prompt": msgs[-1]["content"],
                "domain": domain if isinstance(domain, str) and domain else "general", "reference": reference})
    return out


def load_sources(fetch: Callable[[str], Path], sources: dict[str, list[str]], known_domains: set[str]
                 ) -> tuple[list[dict], dict[str, list[int]], Counter]:
    """source -> its inputs (fetched with `fetch`) -> (rows, row indices per source, skipped counts)."""
    rows: list[dict] = []
    by_source: dict[str, list[int]] = {}
    skipped: Counter = Counter()
    for name, paths in sources.items():
        seen: Counter = Counter()
        for written in paths:
            for src in input_rows(fetch, written, WHAT):
                row = src.data
                r = prompt_row(row, src.where, known_domains)
                if r is None:
                    skipped[f"{name}: bad preference pair"] += 1
                    continue
                rid = str(row.get("id")) if isinstance(row.get("id"), (str, int)) else str(src.number)
                seen[rid] += 1
                r["id"] = f"{name}/{rid}" + (f"#{seen[rid]}" if seen[rid] > 1 else "")
                r["source"] = name
                by_source.setdefault(name, []).append(len(rows))
                rows.append(r)
        if name not in by_source:
            raise PromptDataError(f"prompt source {name!r} ({paths}) holds no usable prompt")
    return rows, by_source, skipped


# -- the reasoning guard's set ---------------------------------------------------------------------
def reasoning_rows(rows: list[Any], settings: Any, source: str) -> list[dict]:
    """Benchmark rows -> verifier rows {id, domain, prompt, reference} (settings: ReasoningEvalSettings)."""
    out = []
    rx = re.compile(settings.answer_regex, re.S | re.M) if settings.answer_regex else None
    for i, row in enumerate(rows[:settings.limit] if settings.limit else rows):
        where = f"{source} row {i + 1}"
        if not isinstance(row, dict):
            raise PromptDataError(f"{where}: a row must be a JSON object")
        q, a = row.get(settings.prompt_field), row.get(settings.answer_field)
        if not isinstance(q, str) or not q.strip():
            raise PromptDataError(f"{where}: field {settings.prompt_field!r} (prompt_field) must be a "
                                  f"non-empty string; the row has {sorted(row)}")
        if a is None:
            raise PromptDataError(f"{where}: field {settings.answer_field!r} (answer_field) is missing; "
                                  f"the row has {sorted(row)}")
        if rx is not None:
            m = rx.search(str(a))
            if m is None:
                raise PromptDataError(f"{where}: answer_regex {settings.answer_regex!r} does not match "
                                      f"{str(a)[-80:]!r}")
            a = m.group(1).strip()
        reference = a if isinstance(a, (dict, list)) else {"answer": str(a)}
        prompt = q + (("\n" + settings.instruction) if settings.instruction else "")
        # a row's own domain wins unless the recipe named one: RL-format rows (e.g. reasoning_gym's)
        # scored by the math verifier read as wrong answers
        own = row.get("domain") if "domain" not in settings.model_fields_set else None
        domain = own if isinstance(own, str) and own else settings.domain
        out.append({"id": str(row.get("id", row.get("idx", i))), "domain": domain,
                    "prompt": prompt, "reference": reference})
    if not out:
        raise PromptDataError(f"reasoning_eval data {source} holds no rows")
    return out
