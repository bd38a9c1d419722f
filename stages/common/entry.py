"""How every stage job runs (the stage contract): `stages/<kind>/job.py` ends with

    if __name__ == "__main__":
        sys.exit(run_job(main, MyKindConfig))

`run_job` reads the job file, parses its config into the kind's config model (once, here:
`main` gets it typed and never validates it again), calls `main(job, cfg)`, and turns the
outcome into the exit status: 0 when `main` returns; 2 when it raises `StageError` (a problem
the user can fix; also a job file that does not parse), printed without a traceback (by rank
0 as it is; other ranks prefix their rank, since a rank can hit a user error its peers do
not, e.g. a shard of a checkpoint); anything else is a bug: its traceback is printed and the
job exits 1 (SystemExit). The process group, when `main` joined one, is left.

After a failure the traceback or message is printed *before* the group is left, and leaving
it is bounded: a peer may still be inside a collective that will never complete, and NCCL's
teardown then waits for it forever, with the cause still unprinted (a 4-GPU resume hung
exactly so: three ranks in `destroy_process_group`, the fourth in a ZeRO-3 all-gather).
Past `LEAVE_GROUP_S` the process exits without it; the launcher sees the exit and stops the
peers.

A failed job then ends its process at once (`_end_failed_process`): Python's own exit waits for
every non-daemon thread, joins every multiprocessing child and runs every finaliser, and what
failed may have left those behind, never to end: a rollout engine that fails to start can
(vLLM's engine core is a non-daemon child process). Every rank of an RL stage whose engines all
failed so sat in its exit until the progress deadline (tests/stages/reasoning_rl/
test_engine_start_failure.py; a split TP=2 run on GPUs hung so after vLLM's failed start).
The process's children are stopped first (an engine's processes hold GPU memory), its output
flushed, then `os._exit` with the job's status. Only when run_job is the process's entry
(`argv` None: the job's own command line); a caller that passes `argv` (a test) gets the status back.

A rank that succeeded after joining a process group ends its process too
(`end_succeeded_process`): what Python's exit does first (non-daemon threads joined, the exit
handlers run), its output flushed, then `os._exit(0)` in place of the interpreter's
finalization. The group's native threads outlive `destroy_process_group` (DeepSpeed and the
engine keep the group), and one that drops the last hold on a finished collective frees the
Python objects of its tensors, which needs the GIL: one that asks for it just as finalization
begins is ended by CPython (`pthread_exit` inside a noexcept destructor), and the rank dies of
SIGABRT ("terminate called without an active exception") with its work done (4 in 150 runs
of tests/stages/rl/test_policy.py's ZeRO-3 ranks; a core dump showed a gloo worker freeing an
all-gather). A rank forked by pipeline.local_ranks is left to return: multiprocessing ends it
with `os._exit` once elastic has its result.
"""
from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

from stages.common.contract import ConfigT, StageError, StageJob
from stages.common.stage_log import StageLogger, flush_all

STACKS_SIGNAL = signal.SIGUSR2  # SIGUSR1 is the job guard's parent-death signal
LEAVE_GROUP_S = 20.0  # a failed rank's wait to leave the process group (see the module docstring)
CHILDREN_GRACE_S = 5.0  # a failed job's child processes' time to end on SIGTERM before SIGKILL


def run_job(main: Callable[[StageJob, ConfigT], Any], config_model: type[ConfigT],
            argv: list[str] | None = None) -> int:
    """Run a stage job's `main(job, cfg)` on the job file named by `argv` (`--job job.json`),
    `cfg` being the job's config as `config_model` (the model the kind registers); the exit
    status (the module docstring). With `argv` None a failed job ends the process itself."""
    owns_process = argv is None
    path = StageJob.path_from_argv(argv)
    try:
        job = StageJob.read(path)
    except StageError as e:  # nothing has started: no stage to name yet
        print(f"{_rank_tag(int(os.environ.get('RANK', '0')))}{e}", file=sys.stderr, flush=True)
        return 2
    faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)  # the process's own fd 2
    if owns_process and not StageLogger.talks_to_mlflow(job.tracking_uri, job.run_id, job.rank):
        # DeepSpeed imports mlflow as it is imported (its autotuner's optional logging):
        # ~4 s of mlflow, pandas & co. in a rank that never logs to MLflow. Marked absent,
        # `import mlflow` fails at once and DeepSpeed goes on without it. Only in a process of
        # the job's own: a caller's process (argv given) keeps its MLflow importable.
        sys.modules.setdefault("mlflow", None)
    failed_with: int | None = 1  # the exit status while not known to have succeeded
    reported = False  # the failure's cause was printed
    joined_group = False
    try:
        job.check_packages()
        main(job, job.typed_config(config_model, path))
        flush_all()  # every metric in MLflow before the job counts as done
        joined_group = _process_group() is not None
        if joined_group:
            # every rank done (rank 0 may still be writing the model) before the group goes:
            # a rank tearing down early aborted its peer's in-flight gloo/shm traffic
            from stages.common.distributed import wait_for_every_rank  # torch's: data stages never load it
            wait_for_every_rank()
        failed_with = None
    except StageError as e:
        print(f"{_rank_tag(job.rank)}{job.stage} ({job.kind}) failed: {e}", file=sys.stderr, flush=True)
        failed_with, reported = 2, True
        _flush_failed_job()
        return 2
    except Exception:
        traceback.print_exc()  # now: leaving the group below may not return
        _flush_failed_job()
        sys.stderr.flush()
        reported = True
        raise _AlreadyReported() from None
    finally:
        _leave_group(failed_with)
        if reported and owns_process:
            _end_failed_process(failed_with)
    if owns_process and joined_group and multiprocessing.parent_process() is None:
        end_succeeded_process()
    return 0


def _flush_failed_job() -> None:
    """A failed job's metrics sent so far, into MLflow too (a tracking error is told, not raised:
    the job's own failure is what it ends with)."""
    try:
        flush_all()
    except Exception as e:
        print(f"metrics not all in MLflow: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _rank_tag(rank: int) -> str:
    """What a user error's message starts with: nothing on rank 0, `[rank N] ` elsewhere."""
    return "" if rank == 0 else f"[rank {rank}] "


class _AlreadyReported(SystemExit):
    """A bug's exit after its traceback was printed (before leaving the group): exit 1, once."""

    def __init__(self):
        super().__init__(1)


def _leave_group(failed_with: int | None) -> None:
    """Leave the process group; after a failure (`failed_with` = the exit status) wait at most
    LEAVE_GROUP_S for it, then exit without it."""
    group = _process_group()
    if group is None:
        return
    if failed_with is None:
        group.destroy_process_group()
        return
    leaving = threading.Thread(target=group.destroy_process_group, daemon=True)
    leaving.start()
    leaving.join(LEAVE_GROUP_S)
    if leaving.is_alive():
        print(f"rank {group.get_rank()}: leaving the process group did not finish in {LEAVE_GROUP_S:.0f}s "
              "(a peer is still in a collective); exiting without it", file=sys.stderr, flush=True)
        os._exit(failed_with)


def _end_failed_process(status: int) -> None:
    """End this process now with `status`, its cause already printed (the module docstring):
    its child processes stopped (SIGTERM, then SIGKILL past CHILDREN_GRACE_S), its output
    flushed, no non-daemon thread, child or finaliser waited for."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + CHILDREN_GRACE_S
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
    # (logging's stream and file handlers flush every record as they write it)
    _flush_std_streams()
    os._exit(status)


def end_succeeded_process() -> NoReturn:
    """End this process, whose work is done and whose process group is left, with status 0
    without the interpreter's finalization (the module docstring): first what Python's own
    exit does before it, in its order: every non-daemon thread joined (concurrent.futures'
    pools told to end first), then the exit handlers (logging's files closed, MLflow's run
    ended, multiprocessing's children joined, temporary directories removed); then stdout and
    stderr flushed. Objects still alive are not finalized: their `__del__` does not run."""
    threading._shutdown()  # what Py_FinalizeEx runs first (wait_for_thread_shutdown)
    atexit._run_exitfuncs()
    _flush_std_streams()
    os._exit(0)


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to save
            pass


def _process_group():
    """torch.distributed when this process joined a group (data stages never import torch)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
