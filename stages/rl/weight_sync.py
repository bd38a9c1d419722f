"""How the trained weights reach the rollout engines, after every update and on resume: every
rank calls `push()` (which returns its wall time); `make_weight_sync` picks the way for the
placement (placement.py). Nothing goes through files.

The policy's parameters travel in buckets of about `rollout.sync_bucket_mb` MiB (consecutive
parameters of one dtype), so ZeRO-3 gathers each parameter once, a bucket per collective.

- `GatherIntoEngines` (colocated: every rank trains and generates). Under ZeRO-3 one
  `GatheredParameters` per bucket (every rank joins its all-gather), and each rank copies the
  full tensors from the gather straight into its own engine (`RolloutEngine.update_weights`);
  under ZeRO 0-2 every rank holds the full parameters already and copies them. The only
  bytes on the interconnect are ZeRO-3's all-gather.
- `BroadcastToEngines` (split: the engines are other ranks). The trainers gather each bucket
  (ZeRO-3: every trainer joins), trainer 0 packs it into one flat buffer and broadcasts it
  over the sync group (trainer 0 and the engine ranks; NCCL on GPUs); every engine rank
  unpacks views of the buffer into its engine. The bucket layout (names, shapes, dtypes)
  reaches the engines once, at set-up.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Protocol

import torch

from stages.common.distributed import Ranks, make_group
from stages.common.groups import Group
from stages.rl.engines.protocol import RolloutEngine
from stages.rl.placement import Placement

# (name, shape, dtype) of each parameter of a bucket
Layout = list[list[tuple[str, tuple[int, ...], torch.dtype]]]


class WeightSync(Protocol):
    bytes: int  # what one sync carries: the policy's parameters

    def push(self) -> float:
        """Every rank calls it; the engines hold the policy's current weights when it returns.
        Returns the wall time (seconds)."""
        ...


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape, also while ZeRO-3 holds it partitioned (then `ds_shape`)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive parameters of one dtype, at most `bucket_bytes` a bucket (a larger parameter
    gets a bucket of its own)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, p in named:
        nbytes = _numel(full_shape(p)) * p.element_size()
        if not out or out[-1][0][1].dtype != p.dtype or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, p))
        size += nbytes
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def gathered(params: list[torch.Tensor], zero3: bool):
    """The full parameters inside the block: ZeRO-3 all-gathers them (every rank of their
    data-parallel group joins), otherwise they are full already."""
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class GatherIntoEngines:
    def __init__(self, module: torch.nn.Module, engine: RolloutEngine, zero3: bool, bucket_bytes: int):
        self.engine, self.zero3 = engine, zero3
        self.buckets = buckets(list(module.named_parameters()), bucket_bytes)
        self.bytes = sum(_numel(full_shape(p)) * p.element_size() for b in self.buckets for _, p in b)

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets:
            with gathered([p for _, p in bucket], self.zero3):
                for name, p in bucket:
                    yield name, p.data

    def push(self) -> float:
        t0 = time.perf_counter()
        self.engine.update_weights(self._full_tensors())
        return time.perf_counter() - t0


class BroadcastToEngines:
    """`module` on trainer ranks (None on engine ranks), `engine` on engine ranks; `sync` is the
    group of trainer 0 (member 0) and the engine ranks (None on the other trainers)."""

    def __init__(self, module: torch.nn.Module | None, engine: RolloutEngine | None, zero3: bool,
                 bucket_bytes: int, sync: Group | None, is_trainer0: bool):
        self.engine, self.zero3, self.sync = engine, zero3, sync
        self.buckets = buckets(list(module.named_parameters()), bucket_bytes) if module is not None else []
        layout = self._layout() if is_trainer0 else None
        if sync is not None:
            layout = sync.broadcast_object(layout, 0)
        self.layout = layout or []
        self.bytes = sum(_numel(shape) * dtype.itemsize for b in (layout or self._layout()) for _, shape, dtype in b)

    def _layout(self) -> Layout:
        return [[(name, full_shape(p), p.dtype) for name, p in b] for b in self.buckets]

    def push(self) -> float:
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.update_weights(self._received())
        else:
            self._send()
        return time.perf_counter() - t0

    def _send(self) -> None:
        """Trainers: gather each bucket (ZeRO-3), trainer 0 broadcasts it flat."""
        for bucket in self.buckets:
            with gathered([p for _, p in bucket], self.zero3):
                if self.sync is not None:
                    flat = torch.cat([p.data.reshape(-1) for _, p in bucket])
                    self.sync.broadcast_(flat, 0)
        if self.sync is not None and self.sync.device.type == "cuda":
            torch.cuda.synchronize(self.sync.device)

    def _received(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.layout:
            flat = torch.empty(sum(_numel(shape) for _, shape, _ in bucket), dtype=bucket[0][2],
                               device=self.sync.device)
            self.sync.broadcast_(flat, 0)
            offset = 0
            for name, shape, _ in bucket:
                n = _numel(shape)
                yield name, flat[offset:offset + n].view(shape)
                offset += n


def make_weight_sync(placement: Placement, ranks: Ranks, module: torch.nn.Module | None,
                     engine: RolloutEngine | None, zero3: bool, bucket_bytes: int) -> WeightSync:
    """The weight sync of the placement (every rank calls it: the sync group is made here)."""
    if not placement.split:
        return GatherIntoEngines(module, engine, zero3, bucket_bytes)
    members = [placement.trainers.start, *placement.engines]
    sync = make_group(ranks, "weight-sync", members)
    return BroadcastToEngines(module, engine, zero3, bucket_bytes, sync, ranks.rank == placement.trainers.start)
