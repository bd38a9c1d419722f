"""The `torch` rollout engine (engine.py) and its pieces: the static KV cache (kv_cache.py),
decode attention (attention.py), sampling (sampling.py) and CUDA graphs of the decode step
(cuda_graphs.py). Importing the package registers the engine as "torch"."""
from __future__ import annotations

from stages.rl.engines.protocol import register_engine

from .engine import TorchEngine, make_torch_engine, resolve_dtype

register_engine("torch")(make_torch_engine)

__all__ = ["TorchEngine", "make_torch_engine", "resolve_dtype"]
