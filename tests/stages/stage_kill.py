"""Shared by the kill -9 / resume tests: stop a stage job hard once it has checkpointed."""
from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path


def kill_tree(pid: int) -> None:
    """kill -9 of a process we started and of everything below it (the stage job runs in
    its own session, so its process group is not ours)."""
    import psutil

    try:
        victims = [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    victims += victims[0].children(recursive=True)
    for v in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            v.kill()
    psutil.wait_procs(victims, timeout=30)


def kill_after_first_checkpoint(proc: subprocess.Popen, stage_root: Path, stage_glob: str,
                                timeout_s: float, what: str) -> Path:
    """Wait until a complete checkpoint of the stage exists, kill -9 the job, return its dir."""
    deadline = time.time() + timeout_s
    try:
        while not list(stage_root.glob(f"{stage_glob}/checkpoints/step-*/_COMPLETE")):
            assert proc.poll() is None, f"the first {what} run ended before writing a checkpoint"
            assert time.time() < deadline, f"no checkpoint within {timeout_s:.0f} s"
            time.sleep(0.05)
    finally:
        kill_tree(proc.pid)
    return next(stage_root.glob(stage_glob))
