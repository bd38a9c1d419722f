"""Process-group plumbing shared by the distributed stages: init (gloo on CPU, nccl on
GPU), the rank's device, seeding, and the "one rank does it, the others follow" helpers
(`local_first`, `rank0_do`, `broadcast`)."""
from __future__ import annotations

import os
import random
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from pipeline.stage_api import StageError


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: global rank, world size, node-local rank, and its device."""
    rank: int
    world: int
    local_rank: int
    device: torch.device
    on_gpu: bool


def init_distributed(local_rank: int | None = None, *, world_of_one_without_launcher: bool = False) -> Ranks:
    """Join the process group (nccl when CUDA is available, else gloo) and select this
    rank's device. `local_rank` defaults to $LOCAL_RANK. With `world_of_one_without_launcher`
    a process started without a launcher (no $RANK) becomes a world of one."""
    import deepspeed

    on_gpu = torch.cuda.is_available()
    if world_of_one_without_launcher and "RANK" not in os.environ:
        from pipeline.launch import free_port

        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, device, on_gpu)


def use_bf16(precision: str, on_gpu: bool) -> bool:
    """`precision: bf16`, or `auto` on a GPU; fp32 otherwise."""
    return precision == "bf16" or (precision == "auto" and on_gpu)


def resolve_device(setting: str, key: str, own: torch.device) -> str:
    """A config's device (`key` = its name, e.g. "rollout.device") for this rank: auto = the
    rank's own device, cuda = cuda:0; a CUDA device on a machine without one is the user's error."""
    if setting == "auto":
        return str(own)
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise StageError(f"{key} is {setting!r} but this machine has no CUDA device")
    return "cuda:0" if setting == "cuda" else setting


def seed_all(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the other ranks' argument is ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank0_do(rank: int, fn: Callable[[], Any], what: str) -> Any:
    """Run `fn` on rank 0 and hand its failure to every rank (the result stays on rank 0), so a
    bad input on rank 0 stops all ranks with the same message instead of leaving them waiting.
    Every rank raises StageError: with the message of a StageError raised by `fn`, or
    "`what` failed: ..." for anything else (its traceback printed on rank 0)."""
    result: Any = None
    err: str | None = None
    if rank == 0:
        try:
            result = fn()
        except StageError as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - reported on every rank, then re-raised on rank 0
            err = f"{what} failed: {type(e).__name__}: {e}"
            traceback.print_exc()
    status = broadcast(err)
    if status is not None:
        raise StageError(status)
    return result


def local_first(local_rank: int, fn: Callable[[], Any]) -> Any:
    """Run `fn` on each node's local rank 0 first (fills caches), then on the other ranks.
    An error on local rank 0 does not leave the others waiting: they run `fn` too and
    meet the same (deterministic) error."""
    result, error = None, None
    if local_rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised after the barrier
            error = e
    dist.barrier()
    if local_rank != 0:
        result = fn()
    if error is not None:
        raise error
    return result
