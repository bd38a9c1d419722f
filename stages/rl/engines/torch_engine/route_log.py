"""The experts the torch engine's MoE layers chose, per request and position, during one
`generate` call (routing replay and its metrics: stages/rl/routing.py).

How they are caught: every `MoEFeedForward` of the engine has a `sink`; when it is set, the
block copies its router's top-k index there. A prefill gives each block a fresh [rows x
length, k] sink; the decode step writes into the cache's static `routes` buffer [slots, MoE
layers, k] (`KVCache(route_shape=...)`), so a step captured as a CUDA graph writes there on
every replay, and the host reads the busy rows after the step, like the sampled tokens.

A position's routes are those of the forward that fed it through the model: a prompt (or a
carried-over rollout's whole prefix: it is re-encoded with the current weights) in its
prefill, each new token in the decode step that reads it. The last token a request samples
is never fed (it finished, or the call's budget ran out before its next step), so a request
that got n new tokens has routes for its first len(prompt + generated) + n - 1 positions.
"""
from __future__ import annotations

import numpy as np
import torch

from .moe import MoEFeedForward


class RouteLog:
    """The routes of one `generate` call (module docstring)."""

    def __init__(self, ffns: list[MoEFeedForward], n_requests: int):
        self.ffns = ffns
        self.prefix: list[np.ndarray | None] = [None] * n_requests  # [len(seq), layers, k] from its prefill
        self.steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (requests, positions, routes)

    def start_prefill(self, tokens: int) -> list[torch.Tensor]:
        sinks = []
        for ffn in self.ffns:
            ffn.sink = torch.full((tokens, ffn.top_k), -1, dtype=torch.long, device=ffn.device)
            sinks.append(ffn.sink)
        return sinks

    def end_prefill(self, sinks: list[torch.Tensor], reqs: np.ndarray, lengths: list[int], width: int) -> None:
        """The prefill of `reqs` (rows padded to `width`) is done: keep each row's own positions."""
        for ffn in self.ffns:
            ffn.sink = None
        routes = torch.stack(sinks, dim=1).view(len(reqs), width, len(sinks), -1).cpu().numpy().astype(np.int16)
        for row, (i, n) in enumerate(zip(reqs, lengths)):
            self.prefix[int(i)] = routes[row, :n]

    def point_decode(self, buffer: torch.Tensor) -> None:
        """The decode step writes into `buffer` [slots, layers, k] (the cache's `routes`)."""
        for j, ffn in enumerate(self.ffns):
            if ffn.sink is None or ffn.sink.data_ptr() != buffer[:, j].data_ptr():
                ffn.sink = buffer[:, j]

    def end_decode(self) -> None:
        for ffn in self.ffns:
            ffn.sink = None

    def record_step(self, reqs: np.ndarray, positions: np.ndarray, routes: np.ndarray) -> None:
        self.steps.append((reqs.copy(), positions.copy(), routes.astype(np.int16)))

    def routes(self, fed: list[int]) -> list[np.ndarray | None]:
        """Per request i, its routes for its first fed[i] positions (None without a prefill).
        The decode steps' rows are regrouped by request once (a stable sort keeps time order)."""
        if self.steps:
            reqs = np.concatenate([r for r, _, _ in self.steps])
            order = np.argsort(reqs, kind="stable")
            reqs = reqs[order]
            positions = np.concatenate([p for _, p, _ in self.steps])[order]
            routes = np.concatenate([x for _, _, x in self.steps])[order]
            bounds = np.searchsorted(reqs, np.arange(len(self.prefix) + 1))
        out: list[np.ndarray | None] = []
        for i, (prefix, n) in enumerate(zip(self.prefix, fed)):
            if prefix is None or n <= 0:
                out.append(None)
                continue
            mine = np.full((n, *prefix.shape[1:]), -1, dtype=np.int16)
            mine[:min(len(prefix), n)] = prefix[:n]
            if self.steps:
                pos, got = positions[bounds[i]:bounds[i + 1]], routes[bounds[i]:bounds[i + 1]]
                keep = pos < n
                mine[pos[keep]] = got[keep]
            out.append(mine)
        return out
