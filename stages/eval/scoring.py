"""What an evaluation reports, from the scored responses: per set, decoding and domain (and
"all" domains together, and `domain/task` for rows that name their task family, e.g.
`reasoning_gym/leg_counting`) the accuracy, the unbiased pass@k, the row and response counts, the
mean response length and the share of responses that ended with EOS (the rest were cut at
max_new_tokens). Pure Python: the reports and their tests need no model."""
from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Iterable

ALL_DOMAINS = "all"


@dataclass(frozen=True)
class Scored:
    """One response to one row."""

    row_index: int      # the row's index in its set
    domain: str
    score: float        # the verifier's reward in [0, 1]
    tokens: int         # response length
    ended_by_eos: bool
    task: str | None = None  # the row's task family (its `task` field), reported per domain/task


def groups_of(s: Scored) -> tuple[str, ...]:
    """The report groups a response counts in: its domain, its domain/task, and all."""
    return (s.domain, ALL_DOMAINS) + ((f"{s.domain}/{s.task}",) if s.task else ())


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k). A sample counts as correct when its score is 1."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n (n = {n})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(scored: Iterable[Scored], pass_at: list[int]) -> dict[str, dict[str, float]]:
    """group (domain, domain/task, ALL_DOMAINS) -> {accuracy, pass_at_k..., rows, responses,
    response_len_mean, eos_fraction, and with several samples per row partly_right}. accuracy =
    mean score over every response (greedy: over rows; sampled: the pass@1 estimate with partial
    credit for fractional rewards). partly_right: the share of rows with some but not all samples
    right (score 1): the rows GRPO gets a signal from."""
    by_domain: dict[str, list[Scored]] = {}
    for s in scored:
        for group in groups_of(s):
            by_domain.setdefault(group, []).append(s)
    out: dict[str, dict[str, float]] = {}
    for domain, items in sorted(by_domain.items()):
        per_row: dict[int, list[Scored]] = {}
        for s in items:
            per_row.setdefault(s.row_index, []).append(s)
        m = {"accuracy": sum(s.score for s in items) / len(items),
             "rows": float(len(per_row)), "responses": float(len(items)),
             "response_len_mean": sum(s.tokens for s in items) / len(items),
             "eos_fraction": sum(s.ended_by_eos for s in items) / len(items)}
        if any(len(r) > 1 for r in per_row.values()):
            m["partly_right"] = sum(0 < sum(s.score == 1.0 for s in r) < len(r)
                                    for r in per_row.values()) / len(per_row)
        for k in pass_at:
            m[f"pass_at_{k}"] = sum(pass_at_k(len(r), sum(s.score == 1.0 for s in r), k)
                                 for r in per_row.values()) / len(per_row)
        out[domain] = m
    return out
