"""The prompts of an RL stage: `PromptSet` (what a stage's prompt loader returns to the trainer)
and `render_prompts`, the one way RL prompt rows become token ids (their `messages` through the
chat template, generation prompt added; stages/common/chat.py), rows over `prompt_max_len`
tokens left out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.common.chat import encode_prompt


@dataclass
class PromptSet:
    rows: list[dict]                  # one per prompt: what the reward function reads (id, domain, reference, ...)
    prompt_ids: list[list[int]]       # each row's rendered prompt
    groups: dict[str, list[int]]      # sampling group (a domain, a prompt source) -> its row indices
    weights: dict[str, float] | None  # sampling weight of each group; None: proportional to its size
    summary: dict[str, Any]           # the stage summary's fields about the prompts
    description: str                  # one log line about them


def render_prompts(rows: list[dict], tokenizer, prompt_max_len: int) -> tuple[list[dict], list[list[int]], list[int]]:
    """(kept rows, their prompt ids, the kept rows' indices in `rows`); a row's `messages` is
    the conversation its response continues."""
    kept, ids, index = [], [], []
    for i, row in enumerate(rows):
        enc = encode_prompt(tokenizer, row["messages"])
        if len(enc) <= prompt_max_len:
            kept.append(row)
            ids.append(enc)
            index.append(i)
    return kept, ids, index
