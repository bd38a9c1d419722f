"""Where the suite's CPU goes, per kind of process: run a command (the suite by default) under
Linux process accounting, which records the exact CPU time of every process that ends, and
name each process by its command line, sampled from /proc while it runs.

    python scripts/suite_cpu.py                    # python -m pytest -q
    python scripts/suite_cpu.py -- python -m pytest -q tests/e2e

Needs root and the `acct` package (`accton`, `dump-acct`: apt-get install acct). The suite is
CPU-bound on 2 cores (benchmarks/RESULTS.md, "The test suite and the tiny recipe on 2-core
CPUs"), so its wall time follows the CPU work counted here. A process shorter than the 0.2 s
sampling interval is counted under its short command name.
Accounting sees every process of the machine: run it with nothing else running.
Issue 31's suite-time work used this to pick what to cut.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SAMPLE_S = 0.2


def sample_command_lines(seen: dict[str, tuple[str, str]], stop: threading.Event) -> None:
    """pid -> (parent pid, command line) of every process alive at some sample."""
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            # a guard's child is sampled between fork and exec with the guard's command line:
            # look again until it is the job's (else the job's CPU counts as the guard's)
            if not pid.isdigit() or (pid in seen and "pipeline.job_guard" not in seen[pid][1]):
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            except OSError:  # ended between listdir and read
                continue
            if cmd:
                seen[pid] = (ppid, cmd[:400])
        stop.wait(SAMPLE_S)


def kind_of(cmd: str, seen: dict[str, tuple[str, str]], ppid: str) -> str:
    """A process's kind: the module it runs (`-m`), pytest's own workers, or a forked child
    named after its parent's kind (forked stage ranks keep their launcher's command line)."""
    if "exec(eval(sys.stdin" in cmd:
        return "pytest-xdist workers (the in-process tests)"
    module = re.search(r"-m (\S+)", cmd)
    if module and module.group(1) == "pipeline.job_guard":
        return "pipeline.job_guard"
    if module:
        parent = seen.get(ppid, ("", ""))[1]
        forked = parent == cmd
        return module.group(1) + (" (forked rank)" if forked else "")
    if "spawn_main" in cmd or "forkserver import main" in cmd:
        return "multiprocessing children (spawn/forkserver)"
    if "ray" in cmd.split(" ", 1)[0] or "/ray/" in cmd:
        return "ray"
    return "other: " + cmd[:90].replace("\n", " ")


def main(argv: list[str]) -> int:
    if shutil.which("accton") is None or os.geteuid() != 0:
        print("needs root and the acct package (apt-get install acct)", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1:] if "--" in argv else [sys.executable, "-m", "pytest", "-q"]
    accounting = Path(tempfile.mkstemp(prefix="suite-cpu-", suffix=".acct")[1])
    seen: dict[str, tuple[str, str]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample_command_lines, args=(seen, stop), daemon=True)
    subprocess.run(["accton", str(accounting)], check=True, capture_output=True)
    sampler.start()
    start = time.monotonic()
    try:
        status = subprocess.run(command).returncode
    finally:
        subprocess.run(["accton", "off"], capture_output=True)
        stop.set()
        sampler.join()
    wall = time.monotonic() - start
    cpu, count = collections.Counter(), collections.Counter()
    dump = subprocess.run(["dump-acct", str(accounting)], capture_output=True, text=True, check=True).stdout
    for line in dump.splitlines():
        fields = [f.strip() for f in line.split("|")]
        seconds = (float(fields[2]) + float(fields[3])) / 100  # user + system, in clock ticks
        pid, comm = fields[9], fields[0]
        ppid, cmd = seen.get(pid, ("", ""))
        kind = kind_of(cmd, seen, ppid) if cmd else f"short-lived: {comm}"
        cpu[kind] += seconds
        count[kind] += 1
    accounting.unlink()
    print(f"\n{wall:.0f} s wall, {sum(cpu.values()):.0f} CPU-s in processes that ended (exit status {status})")
    print(f"{'CPU-s':>8} {'procs':>6}  kind")
    for kind, seconds in cpu.most_common(30):
        print(f"{seconds:8.1f} {count[kind]:6d}  {kind}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
