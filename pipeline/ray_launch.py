"""A stage's ranks as workers on a Ray cluster (`launcher: ray`), the way torchrun starts them locally.

    python -m pipeline.ray_launch --address auto --nodes N --gpus-per-node G --cpu-ranks C \\
        --cpus-per-worker 1 --placement-timeout 300 -- -m stages.sft.job --job job.json

This process is the stage job's launcher (pipeline.launch starts it under the job guard and
reads its output, as it does deepspeed's or torchrun's) and the Ray driver:

1. It connects to the cluster and reserves one placement-group bundle per node (STRICT_SPREAD:
   each on its own Ray node; `{GPU: G, CPU: G x cpus_per_worker}`, or C CPU ranks), so the
   nodes' ranks are contiguous, node by node, as a hostfile launch lays them out: the RL split
   placement (`rollout.gpus: k`, the last k ranks generate) puts whole nodes on one role when k
   is a multiple of the ranks per node.
2. One `RankWorker` actor per rank (pipeline/ray_worker.py; one GPU each on GPU nodes). The
   ranks of a node see all the node's stage GPUs (CUDA_VISIBLE_DEVICES, LOCAL_RANK = the index
   of the GPU Ray gave the worker), so NCCL uses NVLink / P2P inside a node.
3. Each worker runs the stage's own entry (`python -m stages.<kind>.job --job job.json`) with
   RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE and MASTER_ADDR:MASTER_PORT = rank 0's
   node IP and a free port there: the job joins its process group by its one path,
   `stages.common.distributed.init_distributed` (torch's env:// rendezvous; NCCL on GPU, gloo
   on CPU; DeepSpeed on top as under the other launchers). Each node's ranks get a job file whose
   scratch dir is the node's own (`node_job`): as on hosts with local disks, also on a shared one.
4. It prints every worker's lines (behind torchrun's `[rankN]:` prefix, which the pipeline
   strips) and polls their exit. The first worker that fails stops the others, and this
   process prints a `[launcher]` line naming it (rank, node, pid) with its own error
   (pipeline.job_output), then exits with its code. SIGINT / SIGTERM (Ctrl-C, a Prefect cancel,
   a lost lease) stop every worker; if this process dies, Ray kills its actors and each
   actor's job guard takes its rank down.

A node must see the checkout at the same path (or have it in its image), the artifact store
(object storage, or a file system shared at the same path), and rank 0 the stage's work dir
(a shared file system, or the driver's node): a worker that does not is refused before any rank
starts, with what is missing (pipeline/ray_worker.py `prepare`). The guide: docs/ray.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.job_output import JobOutput
from pipeline.ray_worker import RankWorker
from pipeline.torchrun_hosts import EXPORTED_ENV
from stages.common.contract import Resources
from stages.common.ray_address import split_address

_POLL_S = 0.2
STOP_GRACE_S = 3.0  # per step of SIGINT -> SIGTERM -> SIGKILL to a worker's job


class LaunchError(Exception):
    """The stage cannot start on the cluster: the user's to fix (the message says what)."""


@dataclass
class Worker:
    rank: int
    local_rank: int
    node_rank: int
    actor: Any
    where: dict[str, Any]

    def describe(self) -> str:
        w = self.where
        return f"worker rank {self.rank} (node {w['host']} {w['ip']}, Ray node {w['node_id'][:8]}, pid {w['pid']})"


class Layout(Resources):
    """The stage's resources (nodes x ranks per node; no hostfile) and what each worker reserves."""

    cpus_per_worker: float = 1.0

    def bundle(self) -> dict[str, float]:
        """One node's share of the placement group."""
        b = {"CPU": self.ranks_per_node * self.cpus_per_worker}
        if self.gpus_per_node:
            b["GPU"] = float(self.gpus_per_node)
        return b


def exported_env() -> dict[str, str]:
    """This process's environment that the workers' jobs get (as torchrun_hosts passes it over ssh)."""
    return {k: v for k, v in os.environ.items() if k.startswith(EXPORTED_ENV) and k != "CUDA_VISIBLE_DEVICES"}


def place_workers(layout: Layout, timeout_s: float) -> tuple[Any, list[Worker]]:
    """The placement group and one actor per rank, ranks numbered node by node."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = "STRICT_SPREAD" if layout.nodes > 1 else "PACK"
    pg = placement_group([layout.bundle() for _ in range(layout.nodes)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        raise LaunchError(f"the Ray cluster has no room for {layout.nodes} node(s) of {layout.bundle()} "
                          f"({strategy}: one per Ray node) within {timeout_s:.0f}s; it has {len(alive)} node(s) "
                          f"and {ray.available_resources()} free (see `ray status`)") from None
    actor_cls = ray.remote(RankWorker)
    env = {"env_vars": exported_env()}
    actors = [(b, actor_cls.options(
        num_cpus=layout.cpus_per_worker, num_gpus=1 if layout.gpus_per_node else 0, max_restarts=0,
        runtime_env=env, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
    ).remote()) for b in range(layout.nodes) for _ in range(layout.ranks_per_node)]
    wheres = ray.get([a.where.remote() for _, a in actors])
    return pg, number_ranks(layout, [(b, a, w) for (b, a), w in zip(actors, wheres)])


def number_ranks(layout: Layout, placed: list[tuple[int, Any, dict[str, Any]]]) -> list[Worker]:
    """Ranks node by node (bundle b holds ranks b x per_node ...); inside a GPU node the local
    rank is the index of the worker's GPU among the node's, so LOCAL_RANK names its cuda device."""
    workers: list[Worker] = []
    for b in range(layout.nodes):
        mine = [(a, w) for bb, a, w in placed if bb == b]
        if layout.gpus_per_node:
            mine.sort(key=lambda aw: _gpu_key(aw[1]["gpus"][0]))
        workers += [Worker(b * layout.ranks_per_node + i, i, b, a, w) for i, (a, w) in enumerate(mine)]
    return workers


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)


def rank_env(worker: Worker, workers: list[Worker], layout: Layout, master: tuple[str, int]) -> dict[str, str]:
    """What a worker's job is told: where it sits in the world, the rendezvous, its GPUs."""
    node = [w for w in workers if w.node_rank == worker.node_rank]
    gpus = ",".join(w.where["gpus"][0] for w in node) if layout.gpus_per_node else ""
    env = {"RANK": str(worker.rank), "LOCAL_RANK": str(worker.local_rank), "WORLD_SIZE": str(layout.world_size),
           "LOCAL_WORLD_SIZE": str(layout.ranks_per_node), "GROUP_RANK": str(worker.node_rank),
           "NODE_RANK": str(worker.node_rank), "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
           "CUDA_VISIBLE_DEVICES": gpus}
    if not layout.gpus_per_node:
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return env


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """The cluster `address` leads to must accept a connection: Ray's own client retries an
    absent GCS for minutes before it gives up, and says "Name or service not known" for an
    address it cannot use. `auto` is checked where Ray takes it: $RAY_ADDRESS, else the
    address the last `ray start` on this machine recorded (a crashed head leaves it behind)."""
    if address != "auto":
        _connect(address, "ray.address", timeout_s, "is the cluster up (`ray status`)?")
        return
    env_address = os.environ.get("RAY_ADDRESS", "")
    if env_address == "local":
        return  # Ray starts a cluster of its own in this process
    if env_address and env_address != "auto":
        _connect(env_address, "ray.address auto is $RAY_ADDRESS", timeout_s, "is the cluster up (`ray status`)? "
                 "Else fix or unset the environment variable RAY_ADDRESS, or set ray.address")
        return
    found = rays_auto_address()
    if found is not None:  # None: no cluster recorded or running here, and Ray says so at once
        _connect(found[0], f"ray.address auto is {found[1]}", timeout_s, "that cluster is down (its head "
                 "stopped or crashed): start it again (`ray start --head`), or set ray.address (or "
                 "$RAY_ADDRESS) to a running cluster's address")


def rays_auto_address() -> tuple[str, str] | None:
    """(address, where it comes from) that `ray.init("auto")` connects to without $RAY_ADDRESS:
    Ray's own resolution (a GCS process running on this machine, else the address file the last
    `ray start` wrote, under $RAY_TMPDIR or /tmp/ray), or None when Ray finds none (it fails at
    once then) or this Ray lacks the functions (2.60's private API: then not checked here)."""
    try:
        from ray._common.utils import get_ray_address_file
        from ray._private.services import get_ray_address_from_environment
        from ray._private.utils import read_ray_address
    except ImportError:
        return None
    try:
        address = get_ray_address_from_environment("auto", None)
        recorded = read_ray_address(None)
        address_file = get_ray_address_file(None)
    except (ConnectionError, TypeError):  # "Could not find any running Ray instance" (ray.init says
        return None  # the same at once), or another Ray's signatures
    if not address or address == "auto":
        return None
    if address == recorded:
        return address, f"Ray's recorded address ({address_file}, written by the last `ray start` on this machine)"
    return address, "the address of the Ray GCS process running on this machine"


def _connect(address: str, what: str, timeout_s: float, hint: str) -> None:
    try:
        host, port = split_address(address)
    except ValueError as e:
        raise LaunchError(f"{what} {address!r}: {e}") from None
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise LaunchError(f"{what} {address!r}: cannot connect to the Ray cluster there: nothing answers at "
                          f"{shown} ({e.strerror or e}); {hint}") from None


def node_job(job_path: str, job_text: str, node_rank: int) -> tuple[str, str]:
    """(path, text) of the job file a node's ranks run with: the stage's job with a scratch dir of
    the node's own under its work_dir. Each node's local rank 0 downloads the inputs and restores
    and uploads its ranks' checkpoint files there, as on hosts with local disks; on a work dir
    shared by the nodes one dir for all would have two nodes write the same files at once."""
    job = json.loads(job_text)
    job["work_dir"] = str(Path(job["work_dir"]) / f"node{node_rank}")
    path = Path(job_path)
    return str(path.with_name(f"{path.stem}-node{node_rank}{path.suffix}")), json.dumps(job, indent=2)


def with_job(program: list[str], job_path: str) -> list[str]:
    """`program` with its --job file replaced."""
    at = program.index("--job") + 1
    return [*program[:at], job_path, *program[at + 1:]]


def _job_path(program: list[str]) -> str:
    if "--job" not in program or program.index("--job") + 1 >= len(program):
        raise LaunchError(f"the program {' '.join(program)} names no --job file")
    return program[program.index("--job") + 1]


class Driver:
    """Starts the workers, relays their output, and stops them all on the first failure or a signal."""

    def __init__(self, layout: Layout, program: list[str], job: dict[str, Any], placement_timeout_s: float):
        self.layout, self.program, self.job = layout, program, job
        self.placement_timeout_s = placement_timeout_s
        self.workers: list[Worker] = []
        self.pg = None
        self.signalled: int | None = None
        self.relaying = False
        self.stopping = False

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.signalled = signum
        if not self.relaying:  # connecting or placing: nothing runs yet, give up at once
            raise KeyboardInterrupt

    def start(self, job_path: str, job_text: str) -> None:
        import ray

        self.pg, self.workers = place_workers(self.layout, self.placement_timeout_s)
        cwd = os.getcwd()
        jobs = {w.rank: node_job(job_path, job_text, w.node_rank) for w in self.workers}
        problems = ray.get([w.actor.prepare.remote(w.rank, job_path, job_text, jobs[w.rank], cwd)
                            for w in self.workers])
        bad = [(w, p) for w, p in zip(self.workers, problems) if p]
        if bad:
            raise LaunchError("; ".join(f"{w.describe()}: {p}" for w, p in bad))
        master_port = ray.get(self.workers[0].actor.reserve_port.remote())
        master = (self.workers[0].where["ip"], master_port)
        for w in self.workers:
            print(f"ray_launch: {w.describe()}, local rank {w.local_rank}"
                  + (f", GPU {w.where['gpus'][0]}" if self.layout.gpus_per_node else ""), flush=True)
        self.relaying = True  # from here a signal stops the started workers (relay)
        ray.get([w.actor.start.remote(with_job(self.program, jobs[w.rank][0]),
                                      rank_env(w, self.workers, self.layout, master), cwd) for w in self.workers])

    def relay(self) -> int:
        """Print the workers' lines until all exited; on the first failure (or a signal) stop
        the others. Returns the exit status of this launch."""
        import ray

        codes: dict[int, int] = {}
        failed: tuple[Worker, str] | None = None
        own_lines: dict[int, list[str]] = {w.rank: [] for w in self.workers}
        while len(codes) < len(self.workers):
            polls = [(w, w.actor.poll.remote()) for w in self.workers if w.rank not in codes]  # all in flight
            ended: list[Worker] = []
            for w, ref in polls:
                try:
                    lines, code = ray.get(ref)
                except ray.exceptions.RayError as e:  # the actor or its node is gone
                    lines, code = [f"ray_launch: {w.describe()} was lost: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}"], 1
                for line in lines:
                    print(f"[rank{w.rank}]: {line}", flush=True)
                own_lines[w.rank] = (own_lines[w.rank] + lines)[-400:]
                if code is not None:
                    codes[w.rank] = code
                    ended.append(w)
            # of the workers that failed within one poll, a killed one (128 + N) is the cause: the
            # others saw it vanish (a peer's exit takes longer than a kill)
            bad = sorted((w for w in ended if codes[w.rank] != 0), key=lambda w: (codes[w.rank] <= 128, w.rank))
            if bad and failed is None and self.signalled is None:
                failed = (bad[0], self._own_error(codes[bad[0].rank], own_lines[bad[0].rank]))
            if (failed or self.signalled) and len(codes) < len(self.workers) and not self.stopping:
                self.stopping = True
                self._stop_all()
            time.sleep(_POLL_S)
        if self.signalled:
            return 128 + self.signalled
        if failed:
            worker, error = failed
            print(f"[launcher] {worker.describe()} failed first: {error}", flush=True)
            return codes[worker.rank]
        return 0

    def _own_error(self, code: int, lines: list[str]) -> str:
        """The failed worker's own explanation, from its lines alone (its peers' may follow)."""
        out = JobOutput(self.job["stage"], self.job["kind"])
        for line in lines:
            out.feed(line)
        reason = out.failure(code).reason.splitlines()[0]
        if code > 128 and code - 128 in signal.valid_signals():
            reason += f" (killed by {signal.Signals(code - 128).name})"
        return reason

    def _stop_all(self) -> None:
        import ray

        refs = [w.actor.stop.remote(STOP_GRACE_S) for w in self.workers]
        for ref in refs:
            try:
                ray.get(ref, timeout=4 * STOP_GRACE_S)
            except ray.exceptions.RayError:
                pass  # an actor already gone: killed with it below

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.kill(w.actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - the cluster removes it with the job anyway
                pass


def run(address: str, layout: Layout, timeout_s: float, program: list[str]) -> int:
    job_path = _job_path(program)
    job_text = Path(job_path).read_text()
    job = json.loads(job_text)
    driver = Driver(layout, program, job, timeout_s)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, driver.on_signal)
    import ray

    try:
        check_reachable(address)
        try:
            # auto: $RAY_ADDRESS, else the cluster this machine belongs to
            ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=False)
        except Exception as e:  # noqa: BLE001 - ConnectionError, a bad address...: the user's to fix
            raise LaunchError(f"cannot connect to the Ray cluster at {address!r} (ray.address): "
                              f"{type(e).__name__}: {e}") from None
        driver.start(job_path, job_text)
        return driver.relay()
    except LaunchError as e:
        print(f"{job['stage']} ({job['kind']}) failed: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # a stop signal before the workers started
        return 128 + (driver.signalled or signal.SIGINT)
    finally:
        driver.close()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="auto")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument("--cpu-ranks", type=int, default=1)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--placement-timeout", type=float, default=300.0)
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- then python's arguments: -m MODULE ...")
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    layout = Layout(nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpu_ranks=args.cpu_ranks,
                    cpus_per_worker=args.cpus_per_worker)
    return run(args.address, layout, args.placement_timeout, program)


if __name__ == "__main__":
    sys.exit(main())
