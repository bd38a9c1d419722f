"""One rank of a `launcher: ray` stage: a Ray actor that runs the stage's job entry on its node.

`pipeline.ray_launch` (the driver) creates one `RankWorker` per rank inside the stage's
placement group. The actor itself stays light: it reports where Ray put it (node, IP, the GPU
Ray gave it), checks that the node can run the job (the checkout, the job's work dir, the
artifact store), then starts the job exactly as the other launchers do,
`python -m stages.<kind>.job --job job.json` with the torch.distributed variables the driver
computed, and hands its output lines to the driver as they come.

The job is this actor's own child, started through `pipeline.job_guard --exec`: it gets SIGKILL
when the actor dies (Ray kills a dead driver's actors; kill -9 of the actor included), and its
children in turn lose it. `stop` signals the job's process group itself.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from data_curation.urls import filesystem, join
from pipeline.lease import RUNNING
from stages.common.ports import reserved_port

_MAX_LINES_PER_POLL = 5000  # a chatty rank cannot make one poll reply unbounded


class RankWorker:
    """The actor class (the driver wraps it with `ray.remote`)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._ports = contextlib.ExitStack()  # reservations: released when the actor ends

    def where(self) -> dict[str, Any]:
        """The node this actor runs on and the GPUs Ray assigned to it."""
        import ray

        ctx = ray.get_runtime_context()
        gpus = ctx.get_accelerator_ids().get("GPU", [])
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "pid": os.getpid(), "gpus": [str(g) for g in gpus]}

    def reserve_port(self) -> int:
        """A TCP port on this node for rank 0's rendezvous (torch's env:// store), reserved by
        this actor while it lives (stages.common.ports): no other process takes it before the
        rank binds it."""
        return self._ports.enter_context(reserved_port())

    def prepare(self, rank: int, job_path: str, job_text: str, node_job: tuple[str, str], cwd: str) -> str | None:
        """None when this node can run the rank, else the problem (the driver reports it as
        the user's to fix). The job file at the same path with the same content means the
        node shares the pipeline's work dir (a shared file system, or the driver's own node):
        rank 0 needs that, since the pipeline publishes what rank 0 writes to its output dir.
        Another rank gets the job file and its dirs written on its own disk. `node_job` (path,
        text) is the job file this node's ranks run with: written here, once per node's content."""
        if not Path(cwd).is_dir():
            return (f"the run's directory {cwd} does not exist on node {socket.gethostname()}: every node needs "
                    "the checkout (or the image) at the same path as the machine running ring-pipeline")
        job = json.loads(job_text)
        path = Path(job_path)
        shared = path.is_file() and path.read_text() == job_text
        if not shared:
            if rank == 0:
                return (f"rank 0 runs on node {socket.gethostname()}, which does not see the stage's work dir "
                        f"{path.parent} (defaults.work_dir): put the work dir on a file system every node "
                        "mounts at the same path (NFS, EFS, a PVC), since the pipeline publishes what rank 0 "
                        "writes there")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(job_text)
            for key in ("output_dir", "work_dir"):
                Path(job[key]).mkdir(parents=True, exist_ok=True)
        if rank == 0:
            problem = _tracking_problem(job.get("tracking_uri"), Path(cwd))
            if problem:
                return problem
        problem = _store_problem(job["stage_url"], job.get("storage_options") or {})
        if problem is None:
            _write_node_job(*node_job)
        return problem

    def start(self, program: list[str], env: dict[str, str], cwd: str) -> int:
        """Start `python <program>` (the job entry) under the job guard; returns its pid."""
        # the rank itself is this actor's child, SIGKILLed when the actor dies (job_guard --exec)
        guarded = [sys.executable, "-m", "pipeline.job_guard", "--exec", str(os.getpid()), "--",
                   sys.executable, *program]
        self._proc = subprocess.Popen(guarded, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env={**os.environ, **env}, cwd=cwd, start_new_session=True, text=True,
                                      errors="replace", bufsize=1)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        return self._proc.pid

    def _pump(self) -> None:
        for line in self._proc.stdout:  # type: ignore[union-attr]
            with self._lock:
                self._lines.append(line.rstrip("\n"))

    def poll(self) -> tuple[list[str], int | None]:
        """The lines printed since the last poll, and the exit status once the job ended
        (only after its last line was read; 128 + N for signal N, as a shell reports it)."""
        code = self._proc.poll() if self._proc else None
        if code is not None and code < 0:
            code = 128 - code
        if code is not None and self._reader is not None:
            self._reader.join(timeout=5)
        with self._lock:
            lines, self._lines = self._lines[:_MAX_LINES_PER_POLL], self._lines[_MAX_LINES_PER_POLL:]
            more = bool(self._lines)
        return lines, (None if more else code)

    def stop(self, grace_s: float) -> int | None:
        """SIGINT, SIGTERM, then SIGKILL (grace_s apart) to the job's process group; its exit status."""
        proc = self._proc
        if proc is None:
            return None
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group outlived the guard
        except ProcessLookupError:
            pass
        return proc.wait()


def _write_node_job(path: str, text: str) -> None:
    """The node's job file and its scratch dir; the node's workers write the same text, each
    atomically (a shared file system may hold it already)."""
    Path(json.loads(text)["work_dir"]).mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tracking_problem(uri: str | None, cwd: Path) -> str | None:
    """Rank 0 logs the stage's MLflow run: a SQLite tracking DB must be on its node (a relative
    path is the run directory's, where the job runs)."""
    if not uri or not uri.startswith("sqlite:///"):
        return None
    db = cwd / uri[len("sqlite:///"):]
    if db.is_file():
        return None
    return (f"rank 0 runs on node {socket.gethostname()}, which does not see the MLflow database {db} "
            "(tracking.uri): use an MLflow server (tracking.uri: http://...) or put the database on a file "
            "system every node mounts at the same path")


def _store_problem(stage_url: str, options: dict[str, Any]) -> str | None:
    """None when this node sees the stage's artifact dir (its `_RUNNING` lease, written by the
    pipeline before the launch), else why not: a local-path store that is not shared, or an
    object store this node cannot reach or has no credentials for."""
    try:
        fs, path = filesystem(join(stage_url, RUNNING), options)
        if fs.exists(path):
            return None
        why = "is not there"
    except Exception as e:  # noqa: BLE001 - credentials, endpoint, driver: all the user's to fix
        why = f"cannot be read ({type(e).__name__}: {e})"
    local = "://" not in stage_url or stage_url.startswith("file://")
    hint = ("the artifact store is a local path: use object storage (s3://...) or a shared file system "
            "mounted at the same path on every node") if local else \
        "give every node the store's credentials and endpoint (AWS_* variables, storage.options)"
    return f"node {socket.gethostname()} cannot see the stage's artifact dir: {stage_url}/{RUNNING} {why}; {hint}"
