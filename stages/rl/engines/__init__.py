"""Rollout engines behind one protocol (see protocol.py): `torch` (always) and `vllm` (GPU,
import-guarded: when it cannot be used here, UNAVAILABLE["vllm"] says why).

    from stages.rl.engines import create_engine
    engine = create_engine("torch", model_dir, device="cpu", max_batch=64, max_len=4096, seed=0)

`create_engine` is the one factory: the RL trainer (stages/rl/rollouts.py), the tests and
the benchmarks all make engines through it. Importing this package pulls in torch and
transformers only (no tracking, DeepSpeed or MLflow), so benchmarks can use it on a bare GPU
machine.
"""
from __future__ import annotations

from . import (
    torch_engine,  # noqa: F401  registers "torch"
    vllm_engine,  # noqa: F401  registers "vllm" when importable, else UNAVAILABLE
)
from .protocol import ENGINES, UNAVAILABLE, RolloutEngine, RolloutRequest, RolloutUpdate, SamplingParams, register_engine


def create_engine(name: str, model_dir: str, **kwargs) -> RolloutEngine:
    """ENGINES[name](model_dir, **kwargs), with a clear error for unknown/unavailable names."""
    if name in UNAVAILABLE and name not in ENGINES:
        raise RuntimeError(f"rollout engine {name!r} is unavailable here: {UNAVAILABLE[name]}")
    if name not in ENGINES:
        raise KeyError(f"unknown rollout engine {name!r}; known: {sorted(ENGINES)}")
    return ENGINES[name](model_dir, **kwargs)


__all__ = ["ENGINES", "UNAVAILABLE", "RolloutEngine", "RolloutRequest", "RolloutUpdate",
           "SamplingParams", "create_engine", "register_engine"]
