"""How a stage's job starts: its own processes, never the Prefect process.

Distributed kinds go through the `deepspeed` launcher (or `torchrun`, or Ray: `pipeline.ray_launch`)
with the world size from the stage's resources: CPU = N local ranks on gloo, forked from one
warm process by torch's elastic launcher whichever of deepspeed / torchrun is named
(`pipeline.local_ranks`), GPU = one rank per GPU, many nodes = a hostfile (or the nodes of a Ray
cluster). Data stages run as one plain process. Output is saved to the
stage's log file and read as it comes (pipeline.job_output): progress and warnings reach the
console (pipeline.console), and a failure is explained by what the job reported.

A job runs in its own session under `pipeline.job_guard`, which takes the job's process
group down if this process dies; this process stops the group itself when the run is told
to stop (`pipeline.interrupt`) or the stage's lease is lost. From this process's second CPU
job on, a CPU job of this machine (a data stage's process, `pipeline.local_ranks`) is forked,
guard and all, from a warm job server of this process (`pipeline.job_server`: torch,
transformers and DeepSpeed imported once, not once a stage; `pipeline.warm_jobs`); any other
job starts as a process of its own.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from pipeline import console, interrupt, warm_jobs
from pipeline.hang import dump_stacks, hang_report
from pipeline.interrupt import StageInterrupted
from pipeline.job_output import JobOutput
from stages.common import secrets
from stages.common.contract import Launcher, RaySettings, Resources, StageFailed
from stages.common.ports import reserved_port

# Keep NVLink multicast off in every process we start (see the device notes); harmless on CPU.
_CHILD_ENV = {
    "PYTHONUNBUFFERED": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
_POLL_S = 0.5
_HUNG = "hung: "  # marks a deadline's stop reason (_deadline_check)
_COLLECTIVE_AFTER_DEADLINE_S = 60.0  # a collective's own timeout: the deadline's report comes first
_GRACE_S = 5.0  # per step of SIGINT -> SIGTERM -> SIGKILL


@contextlib.contextmanager
def launch_command(entry: str, job_path: Path, resources: Resources, launcher: Launcher,
                   distributed: bool, ray: RaySettings | None = None) -> Iterator[list[str]]:
    """The command line that starts a stage's job now. The rendezvous port it names (unless
    `resources.master_port` fixes one) stays reserved by this process until the block ends:
    run the job inside it (stages.common.ports: no other process takes the port meanwhile)."""
    with reserved_port() as port:
        yield build_command(entry, job_path, resources, launcher, distributed, ray, master_port=port)


def build_command(entry: str, job_path: Path, resources: Resources, launcher: Launcher,
                  distributed: bool, ray: RaySettings | None = None, master_port: int | None = None) -> list[str]:
    """The command line that starts a stage's job (also shown by `ring-pipeline plan`): the
    rendezvous on `resources.master_port`, else on `master_port` (`launch_command` reserves one),
    else on a placeholder."""
    module_args = ["--job", str(job_path)]
    if not distributed or launcher == "local":
        return [sys.executable, "-m", entry, *module_args]
    if launcher == "ray":  # the ranks are workers on the cluster; this process is their driver
        ray = ray or RaySettings()
        return [sys.executable, "-m", "pipeline.ray_launch", "--address", ray.address,
                "--nodes", str(resources.nodes), "--gpus-per-node", str(resources.gpus_per_node),
                "--cpu-ranks", str(resources.cpu_ranks), "--cpus-per-worker", str(ray.cpus_per_worker),
                "--placement-timeout", str(ray.placement_timeout_s), "--", "-m", entry, *module_args]
    port = str(resources.master_port or master_port or "<free port>")
    if resources.gpus_per_node == 0 and resources.nodes == 1 and not resources.hostfile:  # CPU ranks: forked
        return [sys.executable, "-m", "pipeline.local_ranks", "--nproc-per-node", str(resources.ranks_per_node),
                "--master-port", port, "--", "-m", entry, *module_args]
    if launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", port]
        visible = _visible_gpus(resources)
        if visible is not None:
            # DeepSpeed's runner ignores CUDA_VISIBLE_DEVICES once --num_gpus is given and
            # starts on GPUs 0..n-1 of the host, whatever the user pinned; so the pinned GPUs
            # go in as --include, with the variable unset for the runner (it counts the host's
            # GPUs, then sets the variable itself for each rank).
            return ["env", "-u", "CUDA_VISIBLE_DEVICES", *cmd, "--include", f"localhost:{','.join(visible)}",
                    "--module", entry, *module_args]
        if resources.hostfile:
            cmd += ["--hostfile", resources.hostfile, "--num_nodes", str(resources.nodes)]
        else:
            cmd += ["--num_nodes", "1"]
        # On CPU deepspeed reads the same flag as the number of local ranks.
        cmd += ["--num_gpus", str(resources.ranks_per_node), "--module", entry]
        return cmd + module_args
    if launcher == "torchrun":
        if resources.nodes > 1:  # one torchrun per hostfile host, started here or over ssh
            return [sys.executable, "-m", "pipeline.torchrun_hosts", "--hostfile", str(resources.hostfile),
                    "--nodes", str(resources.nodes), "--nproc-per-node", str(resources.ranks_per_node),
                    "--port", port, "--", "-m", entry, *module_args]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc-per-node", str(resources.ranks_per_node), "--master-port", port, "-m", entry, *module_args]
    raise ValueError(f"unknown launcher {launcher!r}")


def pinned_gpus() -> list[str] | None:
    """The GPU ids this process was pinned to with CUDA_VISIBLE_DEVICES; None when not pinned."""
    pinned = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return [d.strip() for d in pinned.split(",") if d.strip()] if pinned else None


def _visible_gpus(resources: Resources) -> list[str] | None:
    """The GPUs a single-node GPU job must run on when the user pinned them with
    CUDA_VISIBLE_DEVICES (the first `gpus_per_node` of them); None when not pinned."""
    ids = pinned_gpus()
    if resources.hostfile or resources.gpus_per_node == 0 or ids is None:
        return None
    if len(ids) < resources.gpus_per_node:
        raise StageFailed(f"resources.gpus_per_node is {resources.gpus_per_node}, but CUDA_VISIBLE_DEVICES="
                          f"{os.environ['CUDA_VISIBLE_DEVICES']!r} makes only {len(ids)} GPU(s) visible: "
                          "pin more GPUs or ask for fewer")
    return ids[:resources.gpus_per_node]


def job_environment(resources: Resources, extra_env: dict[str, str] | None,
                    progress_deadline_s: float | None) -> dict[str, str]:
    """A job's environment: this process's, what every job gets, and `extra_env` (its credentials)."""
    env = {**os.environ, **_CHILD_ENV, **(extra_env or {})}
    if extra_env:  # the job's credentials reach remote nodes too (pipeline.torchrun_hosts)
        env["RING_FORWARD_ENV"] = ",".join(sorted(extra_env))
    if resources.gpus_per_node == 0:
        # CPU ranks share the cores: one intra-op thread pool per rank avoids oversubscription.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // resources.ranks_per_node)))
        env["CUDA_VISIBLE_DEVICES"] = ""
    # the repo root on the path, so `python -m stages.x` works from a source checkout too
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if progress_deadline_s:
        env["RING_COLLECTIVE_TIMEOUT_S"] = str(progress_deadline_s + _COLLECTIVE_AFTER_DEADLINE_S)
    return env


@dataclass
class LaunchResult:
    returncode: int
    log_path: Path
    output: JobOutput  # what the job reported: progress, first and last metric values


def launch_job(command: list[str], stage: str, log_path: Path, resources: Resources,
            extra_env: dict[str, str] | None = None, cwd: str | None = None,
            must_stop: Callable[[], str | None] | None = None, kind: str | None = None,
            progress_deadline_s: float | None = None, tracked: bool = False) -> LaunchResult:
    """Run the job, save its output to `log_path`, show its progress on the console.

    A non-zero exit raises StageFailed with what the job reported (a user error's message,
    else the crash and the log lines around it). A stop request of the run, or a reason
    returned by `must_stop` (polled), stops the job's process group and raises
    StageInterrupted; so does any exception here (Ctrl-C on the main thread) after stopping.
    A job that prints no step, progress or heartbeat line for `progress_deadline_s` is hung:
    its ranks' stacks are dumped into the log, the job is stopped and StageFailed says which
    rank does what (pipeline.hang); its collectives time out a minute later by themselves
    (`RING_COLLECTIVE_TIMEOUT_S`, stages.common.distributed). A `tracked` job logs to MLflow: a
    warm job server started for it warms MLflow's client too (pipeline.job_server).
    """
    env = job_environment(resources, extra_env, progress_deadline_s)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    output = JobOutput(stage, kind)
    show = console.current()
    interrupt.raise_if_stopping(f"stage {stage!r}")
    proc = _start(command, resources, env, cwd, progress_deadline_s, tracked)

    def pump() -> None:
        with open(log_path, "a", encoding="utf-8") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                line = secrets.redact(line)  # a job may print a URL or error holding a credential
                log.write(line)
                log.flush()
                show.stage_output(stage, kind, output.feed(line), output)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    hung = _deadline_check(proc, output, log_path, progress_deadline_s)
    try:
        stopped_because = _wait(proc, must_stop, hung)
    except BaseException:
        stop_group(proc)
        raise
    finally:
        reader.join(timeout=10)
    if stopped_because and stopped_because.startswith(_HUNG):
        raise StageFailed(stopped_because[len(_HUNG):], stage=stage, exit_code=proc.returncode,
                          user_error=False, log_path=log_path)
    if stopped_because:
        raise StageInterrupted(f"stage {stage!r} was stopped: {stopped_because}. Log: {log_path}")
    if proc.returncode != 0:
        failure = output.failure(proc.returncode)
        raise StageFailed(failure.reason, stage=stage, exit_code=proc.returncode, excerpt=failure.excerpt,
                          user_error=failure.user_error, log_path=log_path)
    return LaunchResult(proc.returncode, log_path, output)


# modules that launch ranks as processes of their own, or on other machines: never forked
_LAUNCHERS = frozenset({"deepspeed.launcher.runner", "torch.distributed.run", "pipeline.torchrun_hosts",
                        "pipeline.ray_launch"})


def _start(command: list[str], resources: Resources, env: dict[str, str], cwd: str | None,
           progress_deadline_s: float | None, tracked: bool) -> subprocess.Popen | warm_jobs.WarmJob:
    """The job under its guard, in a session of its own: a CPU job of this machine may be forked
    from a warm server of this process (pipeline.warm_jobs; the server is made for the job's
    environment without its credentials), any other starts as a process of its own."""
    if resources.gpus_per_node == 0 and resources.nodes == 1 and command[2:3] and command[2] not in _LAUNCHERS:
        common_env = job_environment(resources, None, progress_deadline_s)
        warm = warm_jobs.start_job(command, env, cwd, common_env, tracked)
        if warm is not None:
            return warm
    guarded = [sys.executable, "-m", "pipeline.job_guard", str(os.getpid()), "--", *command]
    return subprocess.Popen(guarded, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=cwd, start_new_session=True, text=True, errors="replace", bufsize=1)


def _deadline_check(proc: subprocess.Popen | warm_jobs.WarmJob, output: JobOutput, log_path: Path,
                    deadline_s: float | None) -> Callable[[], str | None]:
    """A `_wait` check: past the deadline, the ranks' stacks dumped and the report (prefixed
    `_HUNG`); else None."""
    def check() -> str | None:
        silent = time.monotonic() - output.last_progress_at
        if not deadline_s or silent < deadline_s:
            return None
        last = output.last_line
        output.tap = []
        try:
            dumps = dump_stacks(proc.pid, log_path, output.tap)
        finally:
            output.tap = None
        return _HUNG + hang_report(deadline_s, silent, last, dumps)

    return check


def _wait(proc: subprocess.Popen | warm_jobs.WarmJob, must_stop: Callable[[], str | None] | None,
          hung: Callable[[], str | None] = lambda: None) -> str | None:
    """Wait for the job; None when it exited by itself, else why it was stopped."""
    while True:
        try:
            proc.wait(timeout=_POLL_S)
            return None
        except subprocess.TimeoutExpired:
            pass
        reason = interrupt.stop_requested()
        if reason:
            reason = f"the run was interrupted ({reason})"
        elif must_stop:
            reason = must_stop()
        reason = reason or hung()
        if reason:
            stop_group(proc)
            return reason


def stop_group(proc: subprocess.Popen | warm_jobs.WarmJob, grace_s: float = _GRACE_S) -> None:
    """SIGINT, then SIGTERM, then SIGKILL to the job's process group (a second stop request
    skips the waits); then SIGKILL to whatever of the group outlived the guard."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + grace_s
        while proc.poll() is None and time.time() < deadline and not interrupt.hurry():
            time.sleep(0.1)
        if proc.poll() is not None:
            break
    proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
