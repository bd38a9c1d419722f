"""The torch engine's static KV cache and the per-row decode buffers that live with it.

The cache holds `rows` rows of `capacity` positions per layer ([rows, kv_heads, capacity,
head_dim] each for keys and values). It starts at the longest context of a call and doubles
(keeping its contents) whenever a row reaches its end, up to max_len: memory follows the
longest rollout actually decoded, not max_len. It only grows; `free()` gives it back (e.g.
while the trainer runs). Every reallocation invalidates captured CUDA graphs (`on_realloc`).

With `static_shapes`, batch and kv-length sizes are rounded up to powers of two (what CUDA
graphs need; the CPU tests use it to check the GPU's bookkeeping).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch


def pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(1, n)))))


class KVCache:
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, vocab: int, dtype: torch.dtype,
                 device: torch.device, max_len: int, static_shapes: bool, on_realloc: Callable[[], None],
                 route_shape: tuple[int, int] | None = None):
        self.route_shape = route_shape  # (MoE layers, k): a routes row per slot (route_log.py)
        self.routes: torch.Tensor | None = None
        self.n_layers, self.n_kv, self.head_dim, self.vocab = n_layers, n_kv, head_dim, vocab
        self.dtype, self.device, self.max_len, self.static_shapes = dtype, device, max_len, static_shapes
        self.on_realloc = on_realloc
        self.rows = self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def capacity_for(self, length: int) -> int:
        return min(pow2_at_least(length, 16), self.max_len)

    def bucket_rows(self, n: int) -> int:
        return min(pow2_at_least(n), self.rows) if self.static_shapes else n

    def bucket_len(self, n: int) -> int:
        return min(pow2_at_least(n, 16), self.capacity) if self.static_shapes else n

    def free(self) -> None:
        """Release the cache (and the graphs that use it); the next `ensure` reallocates."""
        self.on_realloc()
        self.k, self.v = [], []
        self.rows = self.capacity = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def ensure(self, n_slots: int, length: int) -> None:
        """At the start of a call (nothing cached yet): room for n_slots rows of `length`."""
        if n_slots <= self.rows and length <= self.capacity:
            return
        b = max(n_slots, self.rows)
        cap = max(length, self.capacity)
        self.free()  # captured graphs die with the old buffers
        shape = (b, self.n_kv, cap, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        dev = self.device
        self.tok_in = torch.zeros(b, dtype=torch.long, device=dev)
        self.pos_in = torch.zeros(b, dtype=torch.long, device=dev)
        self.noise = torch.ones(b, self.vocab, dtype=torch.float32, device=dev)
        self.out = torch.zeros(b, 2, dtype=torch.float64, device=dev)  # (token, logprob)
        if self.route_shape is not None:  # the experts each MoE layer chose for a row's input token
            self.routes = torch.full((b, *self.route_shape), -1, dtype=torch.long, device=dev)
        self.positions = torch.arange(cap, device=dev)
        self.row_ids = torch.arange(b, device=dev)  # index tensors of the decode step's cache write
        self.head_ids = torch.arange(self.n_kv, device=dev)
        self.rows, self.capacity = b, cap

    def grow(self, length: int) -> None:
        """Make room for `length` positions mid-call, keeping every row's cached keys/values."""
        if length <= self.capacity:
            return
        cap = min(max(length, 2 * self.capacity, 16), self.max_len)
        if self.static_shapes:
            cap = max(cap, self.capacity_for(length))
        self.on_realloc()
        shape = (self.rows, self.n_kv, cap, self.head_dim)
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):  # one layer at a time: peak = cache + one layer
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                new[:, :, :self.capacity] = old
                cache[i] = new
                del old
        self.positions = torch.arange(cap, device=self.device)
        self.capacity = cap

    def compact(self, busy: np.ndarray, slot_req: np.ndarray, slot_pos: np.ndarray) -> None:
        """Move the busy cache rows (ascending) to the front: rows [0, len(busy))."""
        n = len(busy)
        length = int(slot_pos[busy].max())
        src = torch.from_numpy(busy).to(self.device)
        for cache in (*self.k, *self.v):
            cache[:n, :, :length] = cache[src, :, :length]
        self.tok_in[:n] = self.tok_in[src]
        self.pos_in[:n] = self.pos_in[src]
        self.pos_in[n:] = 0
        slot_req[:n], slot_req[n:] = slot_req[busy], -1
        slot_pos[:n], slot_pos[n:] = slot_pos[busy], 0
