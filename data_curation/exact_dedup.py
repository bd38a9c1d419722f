"""Exact dedup: rows whose normalised text is identical; the first in row order stays.

The key is the normalised (see normalize.py) prompt + response, or the prompt only, or
the response only; formatting-only variants (case, whitespace, punctuation, full-width
digits, zero-width characters) are therefore exact duplicates. Rows with an empty key
are kept (nothing to compare). Keys are 128-bit hashes computed in parallel per part;
first-seen resolution runs in row order in the main process (16 bytes per distinct row).
"""
from __future__ import annotations

from typing import Any, Iterator, Literal

import numpy as np
from pydantic import Field

from data_curation.normalize import NormalizeConfig, Normalizer
from data_curation.row_schema import field_text
from data_curation.step_api import Decision, RunContext, StepConfig, StepRunner


class ExactDedupConfig(StepConfig):
    step: Literal["exact_dedup"] = "exact_dedup"
    key: Literal["text", "prompt", "response"] = Field(
        "text", description="text = prompt + response; prompt = non-assistant turns only")
    normalize: NormalizeConfig = NormalizeConfig()
    max_examples: int = Field(5, ge=0)

    def build(self, ctx: RunContext) -> "ExactDedup":
        return ExactDedup(self)


class ExactDedup(StepRunner):
    mode = "global"

    def __init__(self, cfg: ExactDedupConfig):
        self.cfg = cfg
        self.norm = Normalizer(cfg.normalize)

    def features(self, table) -> np.ndarray:
        import xxhash

        prompts = table.column("_prompt").to_pylist()
        responses = table.column("_response").to_pylist()
        out = np.zeros(len(prompts), dtype="V16")
        h = xxhash.xxh3_128_digest
        for i, (p, r) in enumerate(zip(prompts, responses)):
            key = self.norm.text(field_text(p, r, self.cfg.key))
            if key:
                out[i] = h(key.encode("utf-8", "surrogatepass"))
        return out

    def resolve(self, stream: Iterator[tuple[int, Any, Any]], ctx: RunContext) -> list[Decision]:
        seen: dict[bytes, int] = {}
        group_sizes: dict[int, int] = {}
        decisions = []
        empty = bytes(16)
        for _, rows, keys in stream:
            keep = np.ones(len(rows), dtype=bool)
            details: list[dict | None] = [None] * len(rows)
            reasons: list[str | None] = [None] * len(rows)
            for i, k in enumerate(keys.tolist()):
                if k == empty:
                    continue
                first = seen.get(k)
                if first is None:
                    seen[k] = int(rows[i])
                    continue
                keep[i] = False
                reasons[i] = "exact_duplicate"
                details[i] = {"duplicate_of": first}
                group_sizes[first] = group_sizes.get(first, 1) + 1
            decisions.append(Decision(keep, reasons, details))
        hist: dict[str, int] = {}
        for size in group_sizes.values():
            hist[str(size)] = hist.get(str(size), 0) + 1
        largest = sorted(group_sizes.items(), key=lambda kv: (-kv[1], kv[0]))[: self.cfg.max_examples]
        if decisions:
            decisions[0].stats = {
                "distinct_keys": len(seen), "duplicate_groups": len(group_sizes),
                "group_size_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
                "largest_groups": [{"first_row": r, "size": s} for r, s in largest]}
        return decisions
