"""Scripted stand-ins for the rollout engine and the verifier (pure scheduler tests)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from stages.rl.engines.protocol import RolloutRequest, RolloutUpdate, SamplingParams

EOS = 2


def token_at(pos: int) -> int:
    """The token a scripted rollout emits at response position `pos` (before its EOS)."""
    return 10 + pos % 50


def logprob_at(pos: int, version: int) -> float:
    """Encodes the weights version that sampled the token, so tests can read it back."""
    return -0.01 * (version + 1) - 1e-4 * pos


@dataclass
class Call:
    requests: list[RolloutRequest]
    budget: int | None
    version: int
    updates: list[RolloutUpdate] | None = None


class ScriptedEngine:
    """A lockstep batched decoder: each iteration adds one token to every active request
    (all requests, or `max_batch` slots refilled in request order as requests finish).
    Rollout `uid` ends with EOS at response length `length_of(uid)` (or at its max_new_tokens).
    Honours `finished_token_budget` exactly as the engine protocol says."""

    name = "scripted"

    def __init__(self, length_of: Callable[[str], int], max_batch: int | None = None):
        self.length_of = length_of
        self.max_batch = max_batch  # None: every request decodes at once; else continuous batching
        self.version = 0
        self.calls: list[Call] = []
        self.last_sync_seconds = 0.0

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams,
                 finished_token_budget: int | None = None) -> list[RolloutUpdate]:
        self.calls.append(Call(copy.deepcopy(requests), finished_token_budget, self.version))
        new = [[] for _ in requests]
        lps = [[] for _ in requests]
        reason: list[str | None] = [None] * len(requests)
        done_tokens = 0
        pending = list(range(len(requests)))
        active: list[int] = []
        while active or pending:
            while pending and (self.max_batch is None or len(active) < self.max_batch):
                active.append(pending.pop(0))  # a free slot takes the next queued request
            still = []
            for i in active:
                rq = requests[i]
                pos = len(rq.generated_ids) + len(new[i])
                target = self.length_of(rq.uid)
                tok = EOS if pos + 1 == target else token_at(pos)
                new[i].append(tok)
                lps[i].append(logprob_at(pos, self.version))
                if tok == EOS:
                    reason[i] = "eos"
                elif len(new[i]) == rq.max_new_tokens:
                    reason[i] = "length"
                if reason[i] is not None:
                    done_tokens += len(rq.generated_ids) + len(new[i])
                else:
                    still.append(i)
            active = still
            if finished_token_budget is not None and done_tokens >= finished_token_budget:
                break
        out = [RolloutUpdate(rq.uid, new[i], lps[i], reason[i] is not None, reason[i])
               for i, rq in enumerate(requests)]
        self.calls[-1].updates = out
        return out

    def update_weights(self, named_tensors, partial: bool = False) -> None:
        for _ in named_tensors:
            pass
        self.version += 1


def parity_reward(rows, texts, groups):
    """Score 1 when the response has an even number of tokens (a verifiable toy task)."""
    return [SimpleNamespace(score=float(len(t.split()) % 2 == 0), reason="parity") for t in texts]


def decode(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)
