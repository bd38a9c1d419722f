"""`python -m pipeline.local_ranks --nproc-per-node N --master-port PORT -- -m ENTRY ARGS...`: the
CPU ranks of a single-node job, forked from this one warm process (`pipeline.launch` uses it for
`launcher: deepspeed` / `torchrun` when `resources.gpus_per_node == 0` and `nodes == 1`).

`python -m torch.distributed.run` (and DeepSpeed's runner) start every rank as a fresh
`python -m ENTRY`, and each spends ~4 CPU-s importing torch, transformers' model-loading path and
DeepSpeed before its first step. Here those modules are imported once (the entry module itself,
then DeepSpeed and transformers.modeling_utils, which the jobs import lazily), and the ranks are
forked from this process by torch's own elastic launcher (`elastic_launch`, start method
"fork", the static rendezvous on 127.0.0.1:PORT as torchrun's): the rendezvous, RANK /
LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, stopping the peers of a failed rank and
the failure's exit code stay torch's. Each rank then runs ENTRY as `__main__` (as `python -m`
would, `sys.argv` = ENTRY ARGS: `job_server.run_module_as_main`), so its `run_job` is the
process's entry as before: a failed job still ends its rank at once with its status
(stages.common.entry). This launcher is itself forked from the warm job server when the
pipeline launches it (pipeline.job_server): then its imports are warm already.

What a forked rank gets as a fresh process would: the default SIGINT / SIGTERM / SIGHUP /
SIGQUIT handling (the elastic agent installs handlers of its own before it forks: a rank
blocked in a collective must still die of SIGTERM; the launcher's SIGCHLD handler, FirstFailure,
is not the rank's either), and the exit handlers (atexit) of what it imported run when its
Python ends (a failed job's os._exit skips them, as before); torch's thread count and a thread
pool of its own (`job_server.renew_torch_threads`). Its process name (`/proc/PID/comm`) is `RANK_NAME`: a fork keeps
the launcher's command line and initial environment, so this is where `pipeline.hang` reads
a rank's number from.

Only for CPU ranks: forking a process in which CUDA may have initialised is unsafe, so GPU,
multi-node and Ray jobs keep their launchers (pipeline.launch.build_command).
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from pipeline.job_server import import_warm_modules, name_process, renew_torch_threads, run_module_as_main

RANK_NAME = "ring-rank-{}"  # a forked rank's /proc/PID/comm (at most 15 bytes)


def warm_imports(entry: str) -> None:
    """Import `entry` (not as __main__: its job does not run) and the modules its job imports
    later (`job_server.import_warm_modules`). Not MLflow's: only rank 0 of a tracked stage
    imports them, so here they would only move its cost to this launcher, or add it to an
    untracked stage (forked from the job server, this launcher has them already)."""
    importlib.import_module(entry)
    import_warm_modules(with_mlflow=False)


def run_rank(entry: str, args: list[str]) -> None:
    """A forked rank's body (elastic's entrypoint): the entry module as `__main__`. A job that
    fails ends the process itself (run_job's os._exit); this returns when it succeeded."""
    name_process(RANK_NAME.format(os.environ.get("RANK", "?")))
    renew_torch_threads()
    status = run_module_as_main(entry, args)
    if status != 0:  # e.g. a job file that does not parse: nothing was started
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def rank_in_name(name: str) -> str | None:
    """The rank number in a process name `RANK_NAME` gave (None: not a forked rank's name)."""
    prefix = RANK_NAME.removesuffix("{}")
    return name.removeprefix(prefix) if name.startswith(prefix) else None


class FirstFailure:
    """The rank that failed first, as SIGCHLD tells it (a SIGCHLD handler: runs in the main
    thread, starts no thread). Elastic names one failed rank, the first it finds at its next
    poll: when a rank is killed its peers lose their collective and exit within that poll's
    0.1 s, and the lowest rank, often such a peer, is named. The exited rank is only peeked at
    (WNOWAIT): elastic still reaps it."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.status = 0  # the exit status as a shell shows it: 128 + N for signal N
        self.rank = "?"

    def __call__(self, _signum=None, _frame=None) -> None:
        if self.pid is not None:
            return
        for pid in _child_pids():
            try:
                exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if exited is None or (exited.si_code == os.CLD_EXITED and exited.si_status == 0):
                continue
            self.pid, self.rank = pid, rank_in_name(_comm(pid)) or "?"
            self.status = exited.si_status if exited.si_code == os.CLD_EXITED else 128 + exited.si_status
            return

    def describe(self) -> str:
        how = (f"killed by signal {signal.Signals(self.status - 128).name}" if self.status > 128
               else f"exit code {self.status}")
        return f"local_ranks: rank {self.rank} (pid {self.pid}) failed first ({how}); its peers were stopped"


def _child_pids() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as children:
                pids += [int(p) for p in children.read().split()]
        except OSError:
            continue
    return pids


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def launch(nproc: int, master_port: int, entry: str, args: list[str]) -> int:
    """Fork `nproc` ranks running `entry`; the exit status: 0, else the first failed rank's
    (128 + N for a rank killed by signal N)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    warm_imports(entry)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id="none",
                          rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{master_port}",
                          rdzv_configs={"rank": 0}, max_restarts=0, start_method="fork")
    first = FirstFailure()
    signal.signal(signal.SIGCHLD, first)
    try:
        elastic_launch(config, run_rank)(entry, args)
    except ChildFailedError as failed:
        first()  # a SIGCHLD not handled yet
        if first.pid is not None:
            print(first.describe(), file=sys.stderr, flush=True)
            return first.status
        code = failed.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code if code < 0 else 1
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.local_ranks", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- -m ENTRY ARGS...")
    opts = parser.parse_args(argv)
    program = opts.program[1:] if opts.program[:1] == ["--"] else opts.program
    if len(program) < 2 or program[0] != "-m":
        parser.error("expected `-- -m ENTRY ARGS...` after the options")
    return launch(opts.nproc_per_node, opts.master_port, program[1], program[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
