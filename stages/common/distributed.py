"""Process-group plumbing shared by the distributed stages: init (gloo on CPU, nccl on
GPU), the rank's device, seeding, the groups a launch's ranks talk over (their operations:
stages/common/groups.py), and the "one rank does it, the others follow" helpers (`run_on`,
`every_rank_do`, `local_first`, `broadcast`).

How the ranks of a stage are grouped. Normally all of them form torch.distributed's default
process group, the world DeepSpeed trains over. A stage whose ranks have different jobs (RL
with split placement: some ranks train, the others only generate) gives each role a default
world of its own instead: `init_distributed(split_last=k)` puts the last k ranks in one and
the others in another, because DeepSpeed synchronises its whole default world (barriers in
the ZeRO-3 set-up and in every checkpoint) and would wait for ranks that never train. The
roles then talk over `StandaloneGroup`s: c10d backends of their own, made from the
launcher's rendezvous store (`make_group`). `Ranks.everyone` is the group of all the stage's
ranks either way: the default world, or a standalone group over both roles.
"""
from __future__ import annotations

import itertools
import os
import random
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from stages.common.contract import StageError
from stages.common.extension_cache import use_environment_extension_dir
from stages.common.groups import Group, StandaloneGroup, WorldGroup, collective_timeout


# -- joining --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ranks:
    """Where this process sits: global rank and world size of the launch, node-local rank, its
    device, and the group of all the launch's ranks (the default world, unless the launch was
    split into role worlds: then a standalone group over both)."""
    rank: int
    world: int
    local_rank: int
    device: torch.device
    on_gpu: bool
    everyone: Group = field(default_factory=WorldGroup, compare=False, repr=False)
    store: Any = field(default=None, compare=False, repr=False)  # the rendezvous store of a split launch


def init_distributed(local_rank: int | None = None, *, world_of_one_without_launcher: bool = False,
                     split_last: int = 0) -> Ranks:
    """Join the process group (nccl when CUDA is available, else gloo) and select this
    rank's device. `local_rank` defaults to $LOCAL_RANK. With `world_of_one_without_launcher`
    a process started without a launcher (no $RANK) becomes a world of one. With
    `split_last` = k > 0 the last k ranks get a default world of their own and the others
    another (module docstring); 0 < k < world size."""
    import deepspeed

    use_environment_extension_dir()  # DeepSpeed's CPU backend loads (or first builds) its all-reduce op below
    on_gpu = torch.cuda.is_available()
    if world_of_one_without_launcher and "RANK" not in os.environ:
        # port 0: no other rank connects, so the store binds a port of its own choosing (a
        # port found free beforehand could be taken by another process before it bound it)
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"})
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    backend = "nccl" if on_gpu else "gloo"
    if not split_last:
        deepspeed.init_distributed(dist_backend=backend, timeout=collective_timeout())
        _release_cpu_allreduce_workspace(on_gpu)
        return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, device, on_gpu, WorldGroup(device=device))
    store, rank, world = next(dist.rendezvous("env://", timeout=collective_timeout()))
    if not 0 < split_last < world:
        raise ValueError(f"split_last must be in [1, world size - 1 = {world - 1}], got {split_last}")
    first = world - split_last
    role, members = ("last", range(first, world)) if rank >= first else ("first", range(first))
    dist.init_process_group(backend, store=dist.PrefixStore(f"world/{role}", store),
                            rank=rank - members.start, world_size=len(members), timeout=collective_timeout())
    # $WORLD_SIZE names the world of the default group from now on: DeepSpeed checks its
    # process group against it ($RANK stays the launch's: rank 0 reports the stage's errors)
    os.environ["WORLD_SIZE"] = str(len(members))
    deepspeed.init_distributed(dist_backend=backend, timeout=collective_timeout())
    _release_cpu_allreduce_workspace(on_gpu)
    everyone = StandaloneGroup(store, "everyone", rank, world, device)
    global _split_launch_everyone
    _split_launch_everyone = everyone
    return Ranks(rank, world, local_rank, device, on_gpu, everyone, store)


_split_launch_everyone: Group | None = None  # set by init_distributed on a split launch


def wait_for_every_rank() -> None:
    """Return once every rank of the launch has called it: the end of a stage job, before the
    ranks leave their groups (stages/common/entry.py), so that no rank leaves while a peer is
    still working (rank 0 may be writing the model).

    A split launch waits over all its ranks, not over each role world: NCCL opens a group's
    communicator at the group's first collective, through the launch's store, and that store
    lives in rank 0's process. A role world can reach the end without any collective (the
    second rank of a TP=2 engine only lends its GPU to the engine), so its end barrier opens
    its communicator just as rank 0, past its own role's barrier, exits and takes the store
    along: a split TP=2 run on GPUs fails so after its last step. `everyone`'s communicator
    has carried every step, and rank 0 stays in it until the last rank arrives."""
    if _split_launch_everyone is not None:
        _split_launch_everyone.barrier()
    else:
        dist.barrier()


def _release_cpu_allreduce_workspace(on_gpu: bool) -> None:
    """DeepSpeed's CPU backend (ranks started by its launcher, which sets LOCAL_SIZE) puts each
    rank's all-reduce workspace in /dev/shm, 66 MB, and never unlinks it: every run left its
    ranks' workspaces in RAM for good (19 GB of 24 after a day of test runs). Every rank maps
    every peer's workspace inside `init_distributed`, so after a barrier the names can go; the
    mappings live on until the processes exit, however they exit (SIGKILL included)."""
    if on_gpu or os.environ.get("LOCAL_SIZE") != str(dist.get_world_size()):
        return  # DeepSpeed makes the workspaces only when every rank of the world is local
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    dist.barrier()
    (Path("/dev/shm") / name).unlink(missing_ok=True)


def make_group(ranks: Ranks, name: str, members: Sequence[int]) -> Group | None:
    """The group of the global ranks `members` (in that order), or None on a rank outside it.
    Every rank of the launch calls it, in the same order (a subgroup of the default world is
    collective; a standalone group's rendezvous keys are numbered by that order, so a group
    made again under the same `name` does not meet the earlier one's stale addresses)."""
    members = list(members)
    if ranks.store is None:
        sub = dist.new_group(members, timeout=collective_timeout())
        return WorldGroup(sub, ranks.device) if ranks.rank in members else None
    key = f"{name}/{next(_standalone_groups)}"
    if ranks.rank not in members:
        return None
    return StandaloneGroup(ranks.store, key, members.index(ranks.rank), len(members), ranks.device)


_standalone_groups = itertools.count()  # this process's make_group calls on a split launch


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


# -- one rank does it, the others follow ---------------------------------------------------------------
def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank of the default world (the other ranks' argument is ignored)."""
    return WorldGroup().broadcast_object(obj, 0)


def _failure(fn: Callable[[], Any], what: str) -> tuple[Any, str | None]:
    """fn's result, or the message every rank raises when it fails: a StageError's own, else
    "`what` failed: ..." (the traceback printed here)."""
    try:
        return fn(), None
    except StageError as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        traceback.print_exc()
        return None, f"{what} failed: {type(e).__name__}: {e}"


def run_on(group: Group, src: int, fn: Callable[[], Any], what: str, *, share: bool = False) -> Any:
    """Run `fn` on member `src` of `group` and hand its failure to every member (StageError
    everywhere, so a bad input stops all ranks with one message instead of leaving them
    waiting). The result stays on `src`, or with `share` reaches every member."""
    result, err = _failure(fn, what) if group.rank == src else (None, None)
    if share:
        result, err = group.broadcast_object((result, err), src)
    else:
        err = group.broadcast_object(err, src)
    if err is not None:
        raise StageError(err)
    return result


def every_rank_do(group: Group, fn: Callable[[], Any], what: str) -> Any:
    """Run `fn` on every member; if it fails anywhere, every member raises the first failure's
    message (in member order) as a StageError."""
    result, err = _failure(fn, what)
    errors = [e for e in group.all_gather_objects(err) if e is not None]
    if errors:
        raise StageError(errors[0])
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
