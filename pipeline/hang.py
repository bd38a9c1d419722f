"""A job past its progress deadline (no step, progress or heartbeat line for N minutes): find
its ranks, dump each one's stacks into the stage log, and say what each rank was doing.

The ranks are the job's descendant processes that catch SIGUSR2 (`stages.common.entry`
registers faulthandler for it: every thread's stack to the rank's stderr, which is the stage
log, even while the main thread is blocked inside a collective); the launchers do not catch
it, so they are never signalled (SIGUSR2 would kill them). A rank's number is its $RANK, or
for a rank forked by pipeline.local_ranks its process name. Each rank is signalled alone and
its dump read before the next, so every dump is labelled with its rank in the log.
"""
from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.local_ranks import rank_in_name

STACKS_SIGNAL = signal.SIGUSR2  # stages.common.entry.STACKS_SIGNAL (no stage import here)
_DUMP_QUIET_S = 0.5  # a dump is complete once its rank has been silent this long
_DUMP_MAX_S = 5.0
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ ")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# a main thread inside one of these waits for its peers
_COLLECTIVE = re.compile(r"all_reduce|all_gather|allreduce|allgather|broadcast|barrier|reduce_scatter|"
                         r"gather|scatter|recv|send|wait|_object|monitored_barrier|init_process_group|"
                         r"rendezvous|new_group")


@dataclass
class RankStacks:
    rank: str
    pid: int
    lines: list[str]

    def main_frames(self) -> list[tuple[str, str, str]]:
        """(func, file, line) of the main thread, innermost first (the thread that runs the
        module: its outermost frames are runpy's or `<module>`)."""
        threads: list[list[tuple[str, str, str]]] = []
        for line in self.lines:
            if _THREAD.match(line):
                threads.append([])
            elif threads and (m := _FRAME.match(line)):
                threads[-1].append((m["func"], m["file"], m["line"]))
        main = [t for t in threads if t and (t[-1][0] in ("<module>", "_run_module_as_main")
                                             or any(f[0] == "_run_module_as_main" for f in t))]
        return main[0] if main else (threads[-1] if threads else [])

    def where(self) -> str:
        frames = self.main_frames()
        if not frames:
            return "no stack (it did not answer SIGUSR2)"
        func, file, line = frames[0]
        return f"in {func} ({Path(file).name}:{line})"

    def in_collective(self) -> bool:
        return any(_COLLECTIVE.search(f[0]) for f in self.main_frames()[:8])


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def _catches(pid: int, sig: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith("SigCgt:")), 0)
    return bool(mask & (1 << (sig - 1)))


def _rank_of(pid: int) -> str:
    """The RANK a launcher started the process with; a rank forked by pipeline.local_ranks (its
    environment as /proc shows it is the launcher's) says it in its process name."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    found = {k: v for k, _, v in (e.partition(b"=") for e in env)}
    return rank_in_name(name) or found.get(b"RANK", b"?").decode()


def rank_processes(root: int) -> list[tuple[str, int]]:
    """(rank, pid) of the job's processes under `root` that dump their stacks on SIGUSR2."""
    children, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            if _catches(child, STACKS_SIGNAL):
                out.append((_rank_of(child), child))
    return sorted(out, key=lambda rp: (not rp[0].isdigit(), int(rp[0]) if rp[0].isdigit() else 0, rp[1]))


def dump_stacks(root: int, log_path: Path, tap: list[str]) -> list[RankStacks]:
    """Signal each rank under `root` in turn; `tap` is the list the job's output reader appends
    every new line to. A marker line in the log names the rank whose dump follows."""
    dumps = []
    for rank, pid in rank_processes(root):
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"----- progress deadline: the stacks of rank {rank} (pid {pid}) -----\n")
        start = len(tap)
        try:
            os.kill(pid, STACKS_SIGNAL)
        except ProcessLookupError:
            continue
        deadline, seen, quiet_since = time.monotonic() + _DUMP_MAX_S, start, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if len(tap) != seen:
                seen, quiet_since = len(tap), time.monotonic()
            elif seen > start and time.monotonic() - quiet_since > _DUMP_QUIET_S:
                break
        dumps.append(RankStacks(rank, pid, tap[start:seen]))
    return dumps


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def hang_report(deadline_s: float, silent_s: float, last_line: str | None, dumps: list[RankStacks]) -> str:
    """Why the job was stopped: the deadline, its last line, and each rank's place; a rank
    outside any collective (its peers wait for it) is named first."""
    lines = [(f"no progress for {_span(silent_s)} (progress deadline {_span(deadline_s)}: no step, "
              "progress or heartbeat line): the job's ranks were stopped, their stacks are in the stage log"),
             f"last line of the job: {last_line.strip() if last_line else '(none)'}"]
    culprits = [d for d in dumps if d.main_frames() and not d.in_collective()]
    waiting = [d for d in dumps if d not in culprits]
    for d in culprits:
        lines.append(f"rank {d.rank} is outside any collective (its peers wait for it): {d.where()}")
    for d in waiting:
        lines.append(f"rank {d.rank}: {d.where()}")
    if not dumps:
        lines.append("no rank process answered SIGUSR2 (none was found under the job)")
    return "\n".join(lines)
