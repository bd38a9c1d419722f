"""CUDA graphs of the torch engine's decode step: one per (batch bucket, kv-length bucket,
sampling mode), captured lazily on first use and replayed after, all in one private memory
pool. A failed capture logs a warning and switches the engine to eager decoding (correct,
slower), unless the caller asks for the failure to be raised."""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def __len__(self) -> int:
        return len(self.graphs)

    def clear(self) -> None:
        # The private memory pool dies with its last graph: a handle kept past that point
        # trips the caching allocator's use-count assert at the next capture.
        self.graphs.clear()
        self.pool = None

    def run(self, key: Hashable, body: Callable[[], None], on_failure: str = "eager") -> None:
        """`body()` (a graph-safe decode step for `key`'s shapes): replayed from its graph,
        captured first if needed; eagerly when graphs are off. A failed capture turns graphs
        off (on_failure="eager"), or is raised with graphs left on (on_failure="raise": the
        caller has another body to capture, e.g. the eager step for a compiled one)."""
        if not self.enabled:
            body()
            return
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(body)
            except Exception as e:  # keep decoding correctly, just slower
                if on_failure == "raise":
                    raise
                log.warning("torch engine: CUDA graph capture failed (%s: %s); decoding eagerly",
                            type(e).__name__, e)
                self.enabled = False
                self.clear()
                body()
                return
            self.graphs[key] = graph
        graph.replay()

    def _capture(self, body: Callable[[], None]) -> "torch.cuda.CUDAGraph":
        # Warm-up on a side stream (lazy cuBLAS/SDPA init); it computes exactly what the replay
        # will compute (same inputs), so its cache writes and outputs are harmless.
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (logging, data loading) does not void it
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            body()
        return graph
