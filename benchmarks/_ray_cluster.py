"""A Ray cluster of several nodes on this one machine: one raylet per node, `ray start --head` then
`ray start --address` for the others, each `--block`ed in a process group of its own, torn down by
signalling those groups (never `ray stop`, which stops every Ray process of the user on the host).
Used by the Ray launcher's tests (two CPU nodes) and by benchmarks/ray_vs_deepspeed.py and
benchmarks/ray_fault.py (`host_nodes`: a 4-GPU host as two nodes of two GPUs, each node's raylet
started with its own CUDA_VISIBLE_DEVICES). `rank_process` finds a stage rank's process on such a
cluster, for the kill-one-worker runs.

    with local_ray_cluster(tmp, [Node(cpus=2), Node(cpus=2)]) as address:   # "127.0.0.1:PORT"
        ...
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pipeline.launch import pinned_gpus
from stages.common.ports import reserved_port


@dataclass(frozen=True)
class Node:
    cpus: int
    gpus: int = 0
    env: dict[str, str] = field(default_factory=dict)  # e.g. CUDA_VISIBLE_DEVICES of its GPUs


def host_nodes(smoke: bool, gpus_per_node: int) -> list[Node]:
    """The two Ray nodes a benchmark plays on this host: with `smoke`, two CPU nodes (and this
    process and its children see no GPU, one thread each); else the GPUs this process was given
    (gpu_queue pins them, else 0..2N-1), `gpus_per_node` to each node."""
    if smoke:
        os.environ.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        return [Node(cpus=2), Node(cpus=2)]
    gpus = pinned_gpus() or [str(i) for i in range(2 * gpus_per_node)]
    if len(gpus) < 2 * gpus_per_node:
        raise SystemExit(f"needs {2 * gpus_per_node} GPUs (--gpus-per-node {gpus_per_node}), "
                         f"CUDA_VISIBLE_DEVICES gives {gpus}")
    return [Node(cpus=8, gpus=gpus_per_node,
                 env={"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * gpus_per_node:(i + 1) * gpus_per_node])})
            for i in range(2)]


def rank_process(rank: int, entry: str, under: Path):
    """The process (psutil) of stage entry `entry` (e.g. "stages.sft.job") with $RANK = rank whose
    job file is under `under` (the caller's own: other runs on this machine may have ranks of the
    same entry); None if there is none. On a Ray cluster it is the rank's worker actor's child
    (pipeline/ray_worker.py), so its parent's pid is the one the launcher names."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = p.info["cmdline"] or []
            if entry in cmd and "pipeline.job_guard" not in cmd and str(under) in " ".join(cmd) \
                    and p.environ().get("RANK") == str(rank):
                return p
    return None


def _start(node: Node, args: list[str], log: Path, timeout_s: float, port: Callable[[], int]) -> subprocess.Popen:
    """`ray start ... --block` in its own process group; returns once the node is up. Every port
    a node would take by default is a reserved one (`port()`: held while the cluster runs, see
    stages.common.ports), so clusters of parallel runs do not collide."""
    env = {**os.environ, **node.env, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            # `ray start`, without needing the `ray` script on PATH
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
             f"--num-cpus={node.cpus}", f"--num-gpus={node.gpus}", "--object-store-memory=80000000",
             "--node-ip-address=127.0.0.1",
             f"--dashboard-agent-listen-port={port()}", f"--dashboard-agent-grpc-port={port()}",
             f"--metrics-export-port={port()}", f"--runtime-env-agent-port={port()}", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + timeout_s
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            stop_node(proc)
            raise RuntimeError(f"ray start did not come up (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def stop_node(proc: subprocess.Popen) -> None:
    """The node's whole process group (raylet, GCS, agents, workers), by group id only."""
    for sig, grace_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


@contextlib.contextmanager
def local_ray_cluster(logs: Path, nodes: list[Node], timeout_s: float = 90) -> Iterator[str]:
    """The GCS address of a cluster of `nodes` on this machine (the first is the head)."""
    temp = Path(tempfile.mkdtemp(prefix="ring-ray-", dir="/tmp"))  # Ray's socket paths must stay short
    started: list[subprocess.Popen] = []
    with contextlib.ExitStack() as ports:
        def port() -> int:
            return ports.enter_context(reserved_port())

        gcs = port()
        try:
            started.append(_start(nodes[0], ["--head", f"--port={gcs}", f"--temp-dir={temp}",
                                             "--include-dashboard=false", f"--dashboard-port={port()}"],
                                  logs / "ray-head.log", timeout_s, port))
            for i, node in enumerate(nodes[1:], 1):
                started.append(_start(node, [f"--address=127.0.0.1:{gcs}"], logs / f"ray-node{i}.log", timeout_s,
                                      port))
            yield f"127.0.0.1:{gcs}"
        finally:
            for proc in reversed(started):
                stop_node(proc)
            shutil.rmtree(temp, ignore_errors=True)
