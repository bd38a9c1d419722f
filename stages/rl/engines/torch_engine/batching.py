"""Continuous batching of the torch engine's `generate` (engine.py's module docstring): which
request occupies which KV cache row, when free rows are refilled (prefills in chunks of at most
~prefill_chunk_tokens padded tokens), when busy rows are compacted, one decode step at a time."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from stages.rl.engines.protocol import RolloutRequest

from .call_log import CallLog
from .route_log import RouteLog
from .sampling import SamplingMode


@dataclass
class ContinuousBatch:
    """One `generate` call's continuous batching over the engine's KV cache rows: the
    requests, the rows they occupy (`slot_req`: request index per row, -1 free; `slot_pos`:
    the row's next cache position) and the pending ones (popped from the end, in request
    order); `routes` catches the MoE layers' expert choices when the engine records them."""

    requests: list[RolloutRequest]
    mode: SamplingMode
    calls: CallLog
    stats: dict[str, float]
    pending: list[int]
    n_slots: int
    slot_req: np.ndarray
    slot_pos: np.ndarray
    routes: RouteLog | None = None

    def refill(self, engine) -> None:
        """Free slots get pending requests (prefilled in chunks), batched: once
        refill_min_free slots are free, or all the pending fit, or nothing decodes (one eager
        prefill costs several decode steps of launch overhead)."""
        c, calls, requests, dev, run = engine.cache, self.calls, self.requests, engine.device, self
        free = np.flatnonzero(run.slot_req[:run.n_slots] < 0)
        if not (run.pending and len(free) and (len(free) == run.n_slots or len(free) >= min(
                engine.refill_min_free, len(run.pending)))):
            return
        new = [(int(b), run.pending.pop()) for b in free[:len(run.pending)]]
        # longest first: a prefill chunk pads its rows to its longest, so rows of like
        # length go together (a carried-over rollout can be 2k tokens, a new prompt 50)
        new.sort(key=lambda bi: -(len(requests[bi[1]].prompt_ids) + len(requests[bi[1]].generated_ids)))
        for chunk in _chunks(new, requests, engine.prefill_chunk_tokens):
            if calls.over_budget():  # the rest stay unstarted
                break
            slots = np.array([b for b, _ in chunk])
            reqs = np.array([i for _, i in chunk])
            seqs = [requests[i].prompt_ids + requests[i].generated_ids for i in reqs]
            c.grow(max(len(q) for q in seqs) + 1)
            run.stats["prefill_tokens"] += sum(len(q) for q in seqs)
            run.stats["prefill_padded_tokens"] += len(seqs) * max(len(q) for q in seqs)
            run.stats["prefills"] += 1
            t_prefill = time.perf_counter()
            width = max(len(q) for q in seqs)
            sinks = run.routes.start_prefill(len(seqs) * width) if run.routes else None
            out = engine._prefill(slots.tolist(), seqs, run.mode).cpu().numpy()  # .cpu(): synced
            if run.routes:
                run.routes.end_prefill(sinks, reqs, [len(q) for q in seqs], width)
            run.stats["prefill_seconds"] += time.perf_counter() - t_prefill
            keep = ~calls.record(reqs, out)
            if keep.any():
                rows = slots[keep]
                run.slot_req[rows] = reqs[keep]
                run.slot_pos[rows] = [len(q) for q, k in zip(seqs, keep) if k]
                idx = torch.from_numpy(rows).to(dev)
                c.tok_in[idx] = torch.from_numpy(out[keep, 0]).long().to(dev)
                c.pos_in[idx] = torch.from_numpy(run.slot_pos[rows]).to(dev)

    def decode(self, engine, busy: np.ndarray) -> None:
        """Compact the busy rows to the front once they fit a smaller batch bucket, then one
        decode step for rows [0, bucket)."""
        c, slot_req, slot_pos, run = engine.cache, self.slot_req, self.slot_pos, self
        hi = int(busy[-1]) + 1
        if not run.pending and c.bucket_rows(len(busy)) < c.bucket_rows(hi):
            c.compact(busy, slot_req, slot_pos)
            busy = np.arange(len(busy))
            hi = len(busy)
        nb = c.bucket_rows(hi)
        kv_need = int(slot_pos[busy].max()) + 1
        c.grow(kv_need)
        if run.routes:
            run.routes.point_decode(c.routes)
        engine._decode(nb, c.bucket_len(kv_need), run.mode)
        out = c.out[:hi].cpu().numpy()
        if run.routes:
            run.routes.record_step(slot_req[busy], slot_pos[busy], c.routes[:hi].cpu().numpy()[busy])
        run.stats["decode_steps"] += 1
        run.stats["decode_row_steps"] += nb
        fin = run.calls.record(slot_req[busy], out[busy])
        slot_pos[busy] += 1
        slot_req[busy[fin]], slot_pos[busy[fin]] = -1, 0
        # next inputs: the sampled tokens; positions from the host mirror, where a free
        # row sits at 0 (it rewrites position 0 of its own unused row, never past it)
        c.tok_in[:hi].copy_(c.out[:hi, 0].long())
        c.pos_in[:hi].copy_(torch.from_numpy(slot_pos[:hi]))


def _chunks(new: list[tuple[int, int]], requests: list[RolloutRequest], chunk_tokens: int):
    """Split prefills so that one forward holds at most ~prefill_chunk_tokens padded tokens."""
    chunk: list[tuple[int, int]] = []
    longest = 0
    for b, i in new:
        ln = len(requests[i].prompt_ids) + len(requests[i].generated_ids)
        if chunk and max(longest, ln) * (len(chunk) + 1) > chunk_tokens:
            yield chunk
            chunk, longest = [], 0
        chunk.append((b, i))
        longest = max(longest, ln)
    if chunk:
        yield chunk
