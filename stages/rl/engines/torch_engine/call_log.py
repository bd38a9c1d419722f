"""The bookkeeping of one `generate` call of the torch engine: new tokens per request, why each
finished, and the summed response length of the requests finished in the call (the
`finished_token_budget`'s measure)."""
from __future__ import annotations

import numpy as np

from stages.rl.engines.protocol import RolloutRequest, RolloutUpdate


class CallLog:
    """The bookkeeping of one `generate` call: new tokens per request, why each finished, and
    the summed response length of the requests finished in the call (the budget's measure)."""

    def __init__(self, requests: list[RolloutRequest], eos_ids: list[int], budget: int | None):
        self.n = len(requests)
        self.eos = np.array(eos_ids, dtype=np.int64)
        self.earlier = np.array([len(r.generated_ids) for r in requests], dtype=np.int64)
        self.limit = np.array([r.max_new_tokens for r in requests], dtype=np.int64)
        self.count = np.zeros(self.n, dtype=np.int64)  # new tokens so far, per request
        self.reason: list[str | None] = [None] * self.n
        self.logged: list[tuple[np.ndarray, np.ndarray]] = []  # per step: (requests, [token, logprob])
        self.done_tokens = 0
        self.budget = budget

    def finish_empty(self, i: int) -> None:
        """Request i has no token budget left: finished by length, nothing generated."""
        self.reason[i] = "length"
        self.done_tokens += int(self.earlier[i])

    def over_budget(self) -> bool:
        return self.budget is not None and self.done_tokens >= self.budget

    def record(self, reqs: np.ndarray, out: np.ndarray) -> np.ndarray:
        """One new (token, logprob) per request in `reqs`; returns which of them finished."""
        self.logged.append((reqs, out))
        self.count[reqs] += 1
        is_eos = np.isin(out[:, 0].astype(np.int64), self.eos)
        fin = is_eos | (self.count[reqs] >= self.limit[reqs])
        for j in np.flatnonzero(fin):
            self.reason[reqs[j]] = "eos" if is_eos[j] else "length"
        self.done_tokens += int((self.earlier[reqs[fin]] + self.count[reqs[fin]]).sum())
        return fin

    def updates(self, requests: list[RolloutRequest]) -> list[RolloutUpdate]:
        toks: list[list[int]] = [[] for _ in range(self.n)]
        lps: list[list[float]] = [[] for _ in range(self.n)]
        if self.logged:  # regroup the per-step logs by request (a stable sort keeps time order)
            reqs = np.concatenate([r for r, _ in self.logged])
            outs = np.concatenate([o for _, o in self.logged])
            order = np.argsort(reqs, kind="stable")
            reqs, outs = reqs[order], outs[order]
            bounds = np.searchsorted(reqs, np.arange(self.n + 1))
            for i in range(self.n):
                part = outs[bounds[i]:bounds[i + 1]]
                toks[i] = part[:, 0].astype(np.int64).tolist()
                lps[i] = part[:, 1].tolist()
        return [RolloutUpdate(uid=r.uid, token_ids=toks[i], logprobs=lps[i],
                              finished=self.reason[i] is not None, finish_reason=self.reason[i])
                for i, r in enumerate(requests)]
