"""Run a plan of GPU benchmark jobs on one multi-GPU machine, each on GPUs of its own, as soon
as its GPUs are free and its dependencies are met: one device session's work, all GPUs busy.

    python3 benchmarks/gpu_queue.py benchmarks/gpu_plans/h100x4-round4.yaml --results /tmp/results
    python3 benchmarks/gpu_queue.py PLAN.yaml --results /tmp/r --gpus 4 --check   # here, before a session

A plan is YAML: `jobs:`, a list of {name, gpus, cmd, timeout_s, after: [job names],
needs_file: path, shares: bool}. Jobs start in plan order whenever they can (a later job may start before an
earlier one that waits for GPUs, a dependency or its file). Each job runs `cmd` with bash in the
repository root, with CUDA_VISIBLE_DEVICES set to its GPUs, NVLink multicast off, and $OUT set
to `<results>/<name>/` (the job's result files go there); its output goes to
`<results>/<name>/job.log`. A job past its timeout is killed with its process group.
`<results>/queue.json` (rewritten on every change) says what ran where, when, and how it ended;
a job whose dependency failed is not started (`skipped`). The host's facts go to
`<results>/host.json` when the queue starts, and each job that holds its GPUs has them sampled
while it runs (`<results>/<name>/gpu_telemetry.csv`, summed up per GPU under the job's
`telemetry` in queue.json: clocks, power, temperature, slowdowns; benchmarks/gpu_telemetry.py).

Meant to be started detached (setsid) on a device machine, so that it keeps running between the
short calls that carry more payload or collect its results.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere

from benchmarks._record import SAFE_ENV  # noqa: E402 - needs ROOT on sys.path
from benchmarks.gpu_telemetry import GpuSampler, host_facts, query_fields  # noqa: E402


@dataclass
class Job:
    name: str
    gpus: int
    cmd: str
    timeout_s: float = 600.0
    after: list[str] = field(default_factory=list)
    needs_file: str | None = None
    # true: runs on the machine's first `gpus` GPUs beside whatever holds them, claiming none
    # (work that measures no speed and uses a sliver of a GPU, e.g. several small-model runs)
    shares: bool = False
    state: str = "waiting"  # waiting -> running -> ok | failed | timeout | skipped
    devices: list[int] = field(default_factory=list)
    started: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    proc: subprocess.Popen | None = None
    sampler: GpuSampler | None = None
    telemetry: dict | None = None


def load_plan(path: Path, n_gpus: int) -> list[Job]:
    raw = yaml.safe_load(path.read_text())
    jobs = [Job(**j) for j in raw["jobs"]]
    names = {j.name for j in jobs}
    for j in jobs:
        if j.gpus > n_gpus:
            raise SystemExit(f"{path}: job {j.name!r} wants {j.gpus} GPUs, this machine has {n_gpus}")
        if unknown := set(j.after) - names:
            raise SystemExit(f"{path}: job {j.name!r} runs after unknown job(s) {sorted(unknown)}")
        # a command bash cannot parse fails when its turn comes, GPUs held (round 7: a YAML
        # folded block keeps the line breaks of deeper-indented lines, which split a `for` list)
        syntax = subprocess.run(["bash", "-n", "-c", j.cmd], capture_output=True, text=True)
        if syntax.returncode:
            raise SystemExit(f"{path}: job {j.name!r}: its cmd is not valid bash: {syntax.stderr.strip()}")
    return jobs


class Queue:
    def __init__(self, jobs: list[Job], n_gpus: int, results: Path):
        self.jobs, self.results = jobs, results
        self.free = list(range(n_gpus))
        self.t0 = time.time()
        results.mkdir(parents=True, exist_ok=True)
        (results / "host.json").write_text(json.dumps(host_facts(), indent=1))
        self.telemetry_fields = query_fields()

    def write(self) -> None:
        # pid: the job's bash, leader of its process group (session.sh stop JOB signals the rest)
        rows = [{"name": j.name, "state": j.state, "gpus": j.devices or j.gpus, "exit_code": j.exit_code,
                 "pid": j.proc.pid if j.proc else None,
                 "start_s": None if j.started is None else round(j.started - self.t0, 1),
                 "seconds": None if j.started is None else round((j.ended or time.time()) - j.started, 1),
                 "telemetry": j.telemetry}
                for j in self.jobs]
        tmp = self.results / "queue.json.tmp"
        tmp.write_text(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.t0)),
                                   "jobs": rows}, indent=1))
        tmp.replace(self.results / "queue.json")

    def ready(self, job: Job) -> bool:
        deps = {j.name: j.state for j in self.jobs if j.name in job.after}
        if any(s in ("failed", "timeout", "skipped") for s in deps.values()):
            job.state = "skipped"
            return False
        return (all(s == "ok" for s in deps.values()) and (job.shares or job.gpus <= len(self.free))
                and (job.needs_file is None or Path(job.needs_file).exists()))

    def start(self, job: Job) -> None:
        if job.shares:
            job.devices = list(range(job.gpus))
        else:
            job.devices, self.free = self.free[:job.gpus], self.free[job.gpus:]
        out = self.results / job.name
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **SAFE_ENV, "OUT": str(out),
               "CUDA_VISIBLE_DEVICES": ",".join(map(str, job.devices))}
        log = open(out / "job.log", "w")
        log.write(f"$ {job.cmd}\n# GPUs {job.devices}, started {time.strftime('%H:%M:%S')}\n")
        log.flush()
        job.proc = subprocess.Popen(["bash", "-c", job.cmd], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        job.state, job.started = "running", time.time()
        if not job.shares:  # a sharing job's GPUs are its holder's: their samples are the holder's
            job.sampler = GpuSampler(job.devices, out / "gpu_telemetry.csv", self.telemetry_fields)

    def reap(self, job: Job) -> None:
        rc = job.proc.poll()
        if rc is None and time.time() - job.started > job.timeout_s:
            os.killpg(job.proc.pid, signal.SIGKILL)
            rc = job.proc.wait()
            job.state = "timeout"
        elif rc is None:
            return
        else:
            job.state = "ok" if rc == 0 else "failed"
        job.exit_code, job.ended = rc, time.time()
        if job.sampler:
            job.telemetry = job.sampler.stop()
        if not job.shares:
            self.free = sorted(self.free + job.devices)

    def run(self) -> None:
        while any(j.state in ("waiting", "running") for j in self.jobs):
            for job in self.jobs:
                if job.state == "running":
                    self.reap(job)
            for job in self.jobs:
                if job.state == "waiting" and self.ready(job):
                    self.start(job)
            self.write()
            time.sleep(1.0)
        self.write()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to hand out (default: all present)")
    ap.add_argument("--check", action="store_true", help="only validate the plan (e.g. here, before a device session)")
    args = ap.parse_args()
    n = args.gpus
    if n is None:
        import torch

        n = torch.cuda.device_count()
    jobs = load_plan(args.plan, n)
    if args.check:
        print(f"{args.plan}: {len(jobs)} job(s), valid for {n} GPU(s)")
        return
    Queue(jobs, n, args.results).run()
    sys.exit(0)


if __name__ == "__main__":
    main()
