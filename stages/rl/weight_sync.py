"""How the trained weights reach the rollout engines, after every update and on resume: every
rank calls `push(version)` (which returns its wall time); `make_weight_sync` picks the way for the
placement (placement.py). Nothing goes through files.

What travels is the policy's weights under the base model's names (`sync_tensors`): its
parameters, or for a LoRA policy each adapted layer merged (W + scale * B @ A, computed here
from the gathered W, A and B) and, unless a colocated engine drops its weights while asleep,
only what training changes (the adapted layers and the fully trained modules).

With `rollout.sync_rounding: stochastic` (a `SyncRounding`) each trained fp32 tensor is rounded
to bf16 stochastically on its way (stages/rl/stochastic_rounding.py), seeded from the stage seed,
the policy `version` the push carries and the tensor's name: on each engine rank before its
engine takes it (colocated), on trainer 0 before the broadcast (split: half the bytes travel).

They travel in buckets of about `rollout.sync_bucket_mb` MiB (consecutive
parameters of one dtype), so ZeRO-3 gathers each parameter once, a bucket per collective.

- `GatherIntoEngines` (colocated: every rank trains and generates). Under ZeRO-3 one
  `GatheredParameters` per bucket (every rank joins its all-gather), and each rank copies the
  full tensors from the gather straight into its own engine (`RolloutEngine.update_weights`);
  under ZeRO 0-2 every rank holds the full parameters already and copies them. The only
  bytes on the interconnect are ZeRO-3's all-gather. With tensor-parallel engines
  (placement.py) only a group's first rank holds the engine; the group's other ranks join the
  gathers and copy nothing (the engine's workers take the tensors from the first rank's GPU).
- `BroadcastToEngines` (split: the engines are other ranks). The trainers gather each bucket
  (ZeRO-3: every trainer joins), trainer 0 packs it into one flat buffer and broadcasts it
  over the sync group (trainer 0 and the engine ranks; NCCL on GPUs); every engine rank
  unpacks views of the buffer into its engine. The bucket layout (names, shapes, dtypes)
  reaches the engines once, at set-up.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol

import torch

from stages.common.deepspeed_setup import gathered
from stages.common.distributed import Ranks, make_group
from stages.common.groups import Group
from stages.common.lora import MergedTensor, merged_tensors
from stages.rl.engines.protocol import RolloutEngine
from stages.rl.placement import Placement
from stages.rl.stochastic_rounding import SyncRounding

# (name, shape, dtype) of each parameter of a bucket
Layout = list[list[tuple[str, tuple[int, ...], torch.dtype]]]


class WeightSync(Protocol):
    bytes: int  # what one sync carries: the policy's parameters

    def push(self, version: int) -> float:
        """Every rank calls it; the engines hold the policy's weights of `version` (the updates
        applied so far) when it returns. Returns the wall time (seconds)."""
        ...


def buckets(tensors: list[MergedTensor], bucket_bytes: int,
            sent_dtype: Callable[[MergedTensor], torch.dtype] = lambda t: t.dtype) -> list[list[MergedTensor]]:
    """Consecutive tensors of one dtype as sent (`sent_dtype`), at most `bucket_bytes` of the
    trainer's a bucket (a larger tensor gets a bucket of its own)."""
    out: list[list[MergedTensor]] = []
    size = 0
    for t in tensors:
        nbytes = _numel(t.shape) * t.dtype.itemsize
        if not out or sent_dtype(out[-1][0]) != sent_dtype(t) or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def sync_tensors(module: torch.nn.Module, changed_only: bool) -> list[MergedTensor]:
    """What the engines receive, under the base model's names (the names the engine loaded):
    every parameter; a LoRA policy's adapted layers merged (W + scale * B @ A, stages/common/
    lora.py), and with `changed_only` only those and the fully trained modules (the engine
    holds the frozen rest since it loaded the base)."""
    return merged_tensors(module, changed_only)


def _parts(bucket: list[MergedTensor]) -> list[torch.Tensor]:
    return [p for t in bucket for p in t.parts]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class GatherIntoEngines:
    def __init__(self, module: torch.nn.Module, engine: RolloutEngine | None, zero3: bool, bucket_bytes: int,
                 changed_only: bool = False, rounding: SyncRounding | None = None):
        self.engine, self.zero3, self.partial, self.rounding = engine, zero3, changed_only, rounding
        if rounding is not None and engine is not None:
            rounding.check_engine(engine)
        self.buckets = buckets(sync_tensors(module, changed_only), bucket_bytes)
        self.bytes = sum(_numel(t.shape) * _sent_dtype(t, rounding).itemsize for b in self.buckets for t in b)

    def _full_tensors(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets:
            with gathered(_parts(bucket), self.zero3):
                for t in bucket:
                    yield t.name, _sent(t, self.rounding, version)

    def push(self, version: int) -> float:
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.update_weights(self._full_tensors(version), partial=self.partial)
        else:  # a rank of a tensor-parallel engine's group that runs no engine: it joins the gathers
            for bucket in self.buckets:
                with gathered(_parts(bucket), self.zero3):
                    pass
        return time.perf_counter() - t0


class BroadcastToEngines:
    """`module` on trainer ranks (None on engine ranks), `engine` on engine ranks; `sync` is the
    group of trainer 0 (member 0) and the engine ranks (None on the other trainers)."""

    def __init__(self, module: torch.nn.Module | None, engine: RolloutEngine | None, zero3: bool,
                 bucket_bytes: int, sync: Group | None, is_trainer0: bool, changed_only: bool = False,
                 rounding: SyncRounding | None = None):
        self.engine, self.zero3, self.sync, self.partial, self.rounding = engine, zero3, sync, changed_only, rounding
        if rounding is not None and engine is not None:
            rounding.check_engine(engine)
        self.buckets = (buckets(sync_tensors(module, changed_only), bucket_bytes,
                                lambda t: _sent_dtype(t, rounding)) if module is not None else [])
        layout = self._layout() if is_trainer0 else None
        if sync is not None:
            layout = sync.broadcast_object(layout, 0)
        self.layout = layout or []
        self.bytes = sum(_numel(shape) * dtype.itemsize for b in (layout or self._layout()) for _, shape, dtype in b)

    def _layout(self) -> Layout:
        return [[(t.name, t.shape, _sent_dtype(t, self.rounding)) for t in b] for b in self.buckets]

    def push(self, version: int) -> float:
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.update_weights(self._received(), partial=self.partial)
        else:
            self._send(version)
        return time.perf_counter() - t0

    def _send(self, version: int) -> None:
        """Trainers: gather each bucket (ZeRO-3), trainer 0 broadcasts it flat."""
        for bucket in self.buckets:
            with gathered(_parts(bucket), self.zero3):
                if self.sync is not None:
                    flat = torch.cat([_sent(t, self.rounding, version).reshape(-1) for t in bucket])
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
                     engine: RolloutEngine | None, zero3: bool, bucket_bytes: int,
                     changed_only: bool = False, rounding: SyncRounding | None = None) -> WeightSync:
    """The weight sync of the placement (every rank calls it: the sync group is made here).
    `changed_only`: send only the trained tensors (`sync_tensors`); `rounding`: stochastic
    rounding of the trained fp32 tensors (None: the engines round to nearest)."""
    if not placement.split:
        return GatherIntoEngines(module, engine, zero3, bucket_bytes, changed_only, rounding)
    members = [placement.trainers.start, *placement.engines]
    sync = make_group(ranks, "weight-sync", members)
    return BroadcastToEngines(module, engine, zero3, bucket_bytes, sync, ranks.rank == placement.trainers.start,
                              changed_only, rounding)


def _rounded(t: MergedTensor, rounding: SyncRounding | None) -> bool:
    """Whether the sync rounds `t` stochastically: a trained tensor held exactly in fp32 (an fp32
    parameter, or any adapted layer's merge, computed in fp32 from a bf16 or fp32 W)."""
    return rounding is not None and rounding.rounds(t.exact_dtype, t.changed)


def _sent_dtype(t: MergedTensor, rounding: SyncRounding | None) -> torch.dtype:
    """The dtype `t` travels in: a rounded tensor as bf16 (a frozen fp32 one as fp32: in a split
    sync, another bucket). Both placements count their bytes in it."""
    return torch.bfloat16 if _rounded(t, rounding) else t.dtype


def _sent(t: MergedTensor, rounding: SyncRounding | None, version: int) -> torch.Tensor:
    """What an engine receives of `t` (its gathered parts in hand) in the sync of `version`."""
    if not _rounded(t, rounding):
        return t.value()
    return rounding.apply(t.name, t.value(torch.float32), t.changed, version)
