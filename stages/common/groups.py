"""Collective operations over a set of ranks, by their index in the set: `Group` and its
three kinds. `WorldGroup` is torch.distributed's default process group (or a subgroup of it);
`StandaloneGroup` is a c10d backend of its own over a rendezvous store, which works across
separate default worlds (stages/common/distributed.py says when a launch has those);
`SoloGroup` is one rank without any process group (a scheduler outside a stage job).
Imports only torch, so the benchmarks that use the RL scheduler stay light.
"""
from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist


def collective_timeout() -> timedelta:
    """How long a collective (and joining a group) waits for its peers before it fails: the
    stage's progress deadline plus a minute, which pipeline.launch puts in
    $RING_COLLECTIVE_TIMEOUT_S (so the pipeline's report of a hang comes first and a job run
    without the pipeline still cannot wait forever); 30 minutes without it."""
    return timedelta(seconds=float(os.environ.get("RING_COLLECTIVE_TIMEOUT_S", "1800")))


class Group:
    """Collective operations over a set of ranks, which are addressed by their index in the
    set (`rank` of `size`). Every member calls each operation, in the same order."""

    rank: int
    size: int
    device: torch.device  # where this group's tensors must live (a CUDA device for NCCL)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        """`src`'s tensor into every member's `tensor` (same shape and dtype), in place."""
        raise NotImplementedError

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Elementwise "sum" or "max" over the members, in place."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """`src`'s picklable `obj` on every member (the others' argument is ignored)."""
        raise NotImplementedError

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every member's `obj`, in member order, on every member."""
        raise NotImplementedError

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every member's `obj` on `dst` (in member order); None elsewhere."""
        out = self.all_gather_objects(obj)
        return out if self.rank == dst else None

    def barrier(self) -> None:
        """Return once every member has called it. The host reads the reduced value: an NCCL
        all-reduce only orders the GPU stream, and returns to the host at once (without
        the read, ranks 1-3 of 4 GPUs read a checkpoint file rank 0 had not restored yet; gloo on
        CPU blocks either way)."""
        done = torch.zeros(1, device=self.device)
        self.all_reduce_(done)
        done.item()

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        self.all_reduce_(t, "sum")
        return t.tolist()


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class WorldGroup(Group):
    """torch.distributed's default process group (or a subgroup of it from `dist.new_group`)."""

    def __init__(self, group: Any = None, device: torch.device | None = None):
        self.group = group
        self.device = device if device is not None else _current_device()

    @property
    def rank(self) -> int:  # type: ignore[override]
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:  # type: ignore[override]
        return dist.get_world_size(self.group)

    def _global(self, src: int) -> int:
        return src if self.group is None else dist.get_global_rank(self.group, src)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, self._global(src), group=self.group)

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> None:
        dist.all_reduce(tensor, op=_OPS[op], group=self.group)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

    def all_gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self._global(dst), group=self.group)
        return out


class StandaloneGroup(Group):
    """A c10d backend of its own (gloo on CPU, NCCL on GPU) over `members` of the launch's
    ranks, rendezvousing under `name` in `store`: it works across separate default worlds.
    Objects travel pickled in uint8 tensors."""

    def __init__(self, store: Any, name: str, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        prefixed = dist.PrefixStore(f"group/{name}", store)
        if device.type == "cuda":  # NCCL's watchdog aborts a collective past the timeout
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = collective_timeout()
            self.backend = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self.backend = dist.ProcessGroupGloo(prefixed, rank, size, collective_timeout())

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.backend.broadcast([tensor], opts).wait()

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self.backend.allreduce([tensor], opts).wait()

    def broadcast_object(self, obj: Any, src: int) -> Any:
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast_(length, src)
        if self.rank != src:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast_(payload, src)
        return obj if self.rank == src else pickle.loads(payload.cpu().numpy().tobytes())

    def all_gather_objects(self, obj: Any) -> list[Any]:
        # one broadcast per member: used for set-up and error reports, never per token
        return [self.broadcast_object(obj if r == self.rank else None, r) for r in range(self.size)]

    def close(self) -> None:
        self.backend.shutdown()


class SoloGroup(Group):
    """A group of one rank and no process group (a scheduler used outside a stage job)."""

    rank, size = 0, 1
    device = torch.device("cpu")

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        return None

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> None:
        return None

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def all_gather_objects(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_objects(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj]


SOLO = SoloGroup()


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
