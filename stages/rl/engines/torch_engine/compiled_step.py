"""The torch engine's decode step through `torch.compile` (the engine option `compile`).

The eager step is hundreds of small kernels per layer (HF RMSNorm is several, RoPE ~8 ops on
q and k, SwiGLU three plus the matmuls, the sampling's softmax/argmax/gather): inductor fuses
them into a few Triton kernels (C++ on CPU), and the CUDA graphs of cuda_graphs.py then
replay the compiled kernels. Hence inductor's own cudagraph mode stays off (the default
mode, not "reduce-overhead"): two graph layers over the same buffers would fight. The backend is
the project's one (`$RING_COMPILE_BACKEND`, stages.common.compile_layers: `aot_eager` traces the
same graph without inductor's code generation; a mode is inductor's, so it goes with it only).

One compile per shape signature: dynamic=False specialises on the batch bucket, the kv-length
bucket, the sampling mode and the cache's shape (rows, capacity), so a signature is that
tuple. At most `max_compiles` signatures are compiled (dynamo's recompile limit is raised to
it for these calls only); later signatures run the eager step, which is correct, just slower.
The first use of a signature compiles it (its seconds are logged and summed in
`compile_seconds`). Any failure, of the compile or of its capture in a CUDA graph, warns
once and turns compiling off for the engine: every later step is the eager one.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Hashable

import torch

from stages.common.compile_layers import compile_backend

log = logging.getLogger(__name__)

# batch buckets x kv buckets x sampling modes of one run stay well under this (the
# benchmark's batch-256 run compiles 3 or 4); each signature costs a compile (seconds)
DEFAULT_MAX_COMPILES = 32
# torch.compile modes that leave CUDA graphs to cuda_graphs.py: "max-autotune-no-cudagraphs"
# benchmarks Triton GEMM templates against cuBLAS for each matmul shape (the decode step's
# M = batch matmuls are skinny) and can fuse pointwise epilogues into them (fewer kernels per
# layer); its compile takes minutes longer. "reduce-overhead" / "max-autotune" capture graphs
# of their own over the same buffers: refused.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


class CompiledDecode:
    def __init__(self, body: Callable[..., None], enabled: bool, max_compiles: int = DEFAULT_MAX_COMPILES,
                 mode: str = "default"):
        if max_compiles < 1:
            raise ValueError(f"torch engine: compile_max_shapes must be >= 1, got {max_compiles}")
        if mode not in COMPILE_MODES:
            raise ValueError(f"torch engine: compile_mode must be one of {', '.join(COMPILE_MODES)} (the "
                             f"engine captures its own CUDA graphs); got {mode!r}")
        self.enabled, self.max_compiles, self.mode = bool(enabled), int(max_compiles), mode
        self.compiled: set[Hashable] = set()
        self.compile_seconds = 0.0
        self._warned_full = False
        self._step = None
        if self.enabled:
            try:  # lazy: the compile itself happens at a signature's first call
                backend = compile_backend()
                self._step = torch.compile(body, fullgraph=True, dynamic=False, backend=backend,
                                           mode=None if mode == "default" or backend != "inductor" else mode)
            except Exception as e:
                self.disable(e)

    def step_for(self, signature: Hashable) -> Callable[..., None] | None:
        """The compiled step for `signature`, or None: compiling is off, or the signature is
        beyond `max_compiles` (the caller runs the eager step)."""
        if not self.enabled:
            return None
        if signature in self.compiled:
            return self._call
        if len(self.compiled) >= self.max_compiles:
            if not self._warned_full:
                log.warning("torch engine: %d decode shapes compiled (compile_max_shapes); "
                            "new shapes decode eagerly", self.max_compiles)
                self._warned_full = True
            return None
        return lambda *args: self._first_call(signature, *args)

    def _call(self, *args) -> None:
        with torch._dynamo.config.patch(recompile_limit=self.max_compiles + 1):
            self._step(*args)

    def _first_call(self, signature: Hashable, *args) -> None:
        if signature in self.compiled:  # a graph capture calls the step more than once
            self._call(*args)
            return
        t0 = time.perf_counter()
        self._call(*args)
        seconds = time.perf_counter() - t0
        self.compiled.add(signature)
        self.compile_seconds += seconds
        log.info("torch engine: compiled the decode step for %s in %.1f s", signature, seconds)

    def disable(self, error: BaseException) -> None:
        """Compiling failed (`error`): warn once, and decode eagerly from now on."""
        if self.enabled:
            log.warning("torch engine: the compiled decode step failed (%s: %s); decoding with "
                        "the eager step", type(error).__name__, error)
        self.enabled = False
        self._step = None
