"""The learner's micro batches (learner.py): how a mini-batch's rollouts are spread over ranks
and micro batches of at most `micro_batch_tokens` padded tokens (`plan_micro_batches`), and how
one micro batch becomes right-padded tensors (`collate`), the engine's recorded MoE routes
included (`collate_routes`, for routing replay: routing.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from stages.rl.engines.routes import decode_routes


def plan_micro_batches(lengths: Sequence[int], world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Indices of `lengths` -> per rank, a list of micro-batches (lists of indices).

    Longest first onto the least-loaded rank (LPT); within a rank, consecutive (sorted)
    sequences share a micro-batch while n * max_len <= max_tokens (a longer sequence gets one
    of its own). Ranks are padded with empty micro-batches to the same count."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in order:
        r = min(range(world_size), key=lambda j: (load[j], j))
        per_rank[r].append(i)
        load[r] += lengths[i]
    plans: list[list[list[int]]] = []
    for idx in per_rank:
        mbs: list[list[int]] = []
        for i in idx:  # already longest first
            if mbs and (len(mbs[-1]) + 1) * lengths[mbs[-1][0]] <= max_tokens:
                mbs[-1].append(i)
            else:
                mbs.append([i])
        plans.append(mbs)
    n = max(len(p) for p in plans) if plans else 0
    for p in plans:
        p.extend([] for _ in range(n - len(p)))
    return plans


@dataclass
class MicroBatch:
    input_ids: torch.Tensor      # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    resp_pos: torch.Tensor       # [B, R] position of the hidden state predicting each response token
    targets: torch.Tensor        # [B, R]
    mask: torch.Tensor           # [B, R] bool, response tokens
    infer_logp: torch.Tensor     # [B, R]
    advantages: torch.Tensor     # [B]
    stale: torch.Tensor          # [B, R] bool, sampled by an older policy than theta_old
    dummy: bool = False
    routes: torch.Tensor | None = None  # [B, T, MoE layers, k] the engine's experts, -1 = none (routing.py)


def collate(samples: Sequence[Any], version: int, pad_id: int, device: torch.device) -> MicroBatch:
    """One rollout per row, prompt then response from position 0, pads after it (right padding:
    what PolicyHead's mask-free causal attention relies on)."""
    dummy = not samples
    if dummy:  # keeps collectives in step on a rank with nothing left to do; its loss is 0
        from types import SimpleNamespace

        samples = [SimpleNamespace(prompt_ids=[pad_id], response_ids=[pad_id], infer_logprobs=[0.0],
                                   advantage=0.0, token_versions=lambda: [version])]
    B = len(samples)
    T = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    R = max(len(s.response_ids) for s in samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    pos = torch.zeros((B, R), dtype=torch.long)
    tgt = torch.zeros((B, R), dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.bool)
    inf = torch.zeros((B, R), dtype=torch.float32)
    stale = torch.zeros((B, R), dtype=torch.bool)
    for b, s in enumerate(samples):
        P, n = len(s.prompt_ids), len(s.response_ids)
        if P < 1 or n < 1:
            raise ValueError("every rollout needs a non-empty prompt and response")
        ids[b, :P + n] = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
        att[b, :P + n] = 1
        pos[b, :n] = torch.arange(P - 1, P - 1 + n)
        tgt[b, :n] = torch.tensor(s.response_ids)
        mask[b, :n] = True
        inf[b, :n] = torch.tensor(s.infer_logprobs, dtype=torch.float32)
        stale[b, :n] = torch.tensor([v < version for v in s.token_versions()], dtype=torch.bool)
    adv = torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32)
    if dummy:
        mask.zero_()
    routes = None if dummy else collate_routes(samples, T)
    return MicroBatch(ids.to(device), att.to(device), pos.to(device), tgt.to(device), mask.to(device),
                      inf.to(device), adv.to(device), stale.to(device), dummy,
                      None if routes is None else routes.to(device))


def collate_routes(samples: Sequence[Any], width: int) -> torch.Tensor | None:
    """The rollouts' recorded MoE routes as [B, width, layers, k] (-1 where none), or None when
    no rollout has any (a dense policy, an engine that does not record them)."""
    decoded = [decode_routes(r) if (r := getattr(s, "routes", None)) is not None else None for s in samples]
    shapes = {a.shape[1:] for a in decoded if a is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"rollouts of one batch recorded routes of different shapes {sorted(shapes)}")
    out = torch.full((len(samples), width, *shapes.pop()), -1, dtype=torch.long)
    for b, a in enumerate(decoded):
        if a is not None:
            n = min(len(a), width)
            out[b, :n] = torch.from_numpy(a[:n].astype("int64"))
    return out
