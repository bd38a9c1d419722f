"""What the lines a stage job prints mean to the pipeline: progress, metrics, a user error,
a warning, launcher chatter or plain text.

Every line goes to the stage's log unchanged; the console (pipeline.console) shows only what
the operator needs, and a failed job is explained from what this module kept. The protocol a
stage job speaks (its writer: `stages.common.stage_log.StageLogger`, and `stages.common.entry.run_job`
for user errors):

- `[metrics] {"step": N, "name": value, ...}`: one step's metrics (rank 0). The step also
  counts as progress: N steps done.
- `[progress] {"done": N, "total": T, "unit": "step"}`: how far the job is. A job declares its
  total once at its start (`done` may be the step it resumed from); every key is optional, so
  a stage that logs no metrics per unit of work (curation steps, generated files) reports
  `done` alone as it goes.
- `<stage> (<kind>) failed: <message>` (also `<name> failed: <message>`), printed by rank 0
  before the job exits 2: a problem the user can fix (`stages.common.entry.run_job`). The
  message continues on the following plain lines. Another rank prints the same behind
  `[rank N] `: its message explains the failure too (rank 0 may be stuck in a collective the
  failed ranks never reached, and be stopped by the launcher without a word).
- `<name>: warning: <text>`: something the operator should see even on a quiet console.
- `[heartbeat] <text>`: the job is alive and making progress inside a long step (a stage
  prints it from its main loop, never from a timer thread: a rank blocked in a collective
  must stop heartbeating). With `[metrics]` and `[progress]` it resets the job's progress
  deadline (pipeline.launch, pipeline.hang).
- `[launcher] <text>`: a launcher's account of the worker that failed first (the Ray launcher,
  pipeline/ray_launch.py: its rank, node and pid, and that worker's own error); it is the
  reason a crashed job is reported with, since the failed worker may have printed nothing
  (kill -9) while its peers print the errors of losing it.

Anything else is text: launcher chatter (DeepSpeed's timestamped log lines, deprecation
warnings, library progress bars) is recognised so that a failure report leaves it out.
"""
from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from stages.common.stage_log import HEARTBEAT_MARKER, METRICS_MARKER, PROGRESS_MARKER

_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torchrun's per-rank prefix
_REPORTING_RANK = re.compile(r"^\[rank (\d+)\] ")  # run_job's prefix of a user error on rank N > 0
_WARNING = re.compile(r"^(?:[\w.-]+: )?warning: ", re.IGNORECASE)
_TRACEBACK = "Traceback (most recent call last):"
_LAUNCHER = "[launcher] "
# Lines that explain nothing about a failure (the launcher and libraries talking)
_CHATTER = tuple(re.compile(p) for p in (
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(?:INFO|WARNING|DEBUG|ERROR)\] \[[\w.]+:\d+:\w+\]",  # DeepSpeed
    r"^DeepSpeed .* built successfully$",
    r"^\S+\.py:\d+: (?:Future|Deprecation|User)Warning: ",
    r"^\s+(?:return func\(|warnings\.warn\()",  # the source line Python prints under a warning
    r"^[^|]{0,80}:\s+\d+%\|",  # a tqdm bar
    r"^\S*(?:W|I)\d{4} \d\d:\d\d:\d\d",  # glog / torch elastic
))
FAILURE_LINES = 10  # lines of context shown for a job that crashed


@dataclass
class Line:
    """One line of a job's output, as the pipeline reads it."""

    kind: str  # metrics | progress | heartbeat | error | warning | launcher | chatter | text | blank
    text: str
    data: dict[str, Any] = field(default_factory=dict)


def classify(raw: str, user_error_prefixes: tuple[str, ...] = ()) -> Line:
    text = _RANK_PREFIX.sub("", raw.rstrip("\r\n"))
    if not text.strip():
        return Line("blank", text)
    if text.startswith(HEARTBEAT_MARKER):
        return Line("heartbeat", text)
    if text.startswith(_LAUNCHER):
        return Line("launcher", text, {"message": text[len(_LAUNCHER):].strip()})
    for marker, kind in ((METRICS_MARKER, "metrics"), (PROGRESS_MARKER, "progress")):
        if text.startswith(marker):
            try:
                data = json.loads(text[len(marker):])
            except ValueError:
                return Line("text", text)
            return Line(kind, text, data) if isinstance(data, dict) else Line("text", text)
    reporter = _REPORTING_RANK.match(text)
    body = text[reporter.end():] if reporter else text
    for prefix in user_error_prefixes:
        if body.startswith(prefix):
            rank = int(reporter.group(1)) if reporter else 0
            message = body[len(prefix):]
            return Line("error", text, {"message": f"[rank {rank}] {message}" if rank else message, "rank": rank})
    if _WARNING.match(text):
        return Line("warning", text)
    if any(p.search(text) for p in _CHATTER):
        return Line("chatter", text)
    return Line("text", text)


@dataclass
class JobProgress:
    """How far a job is, from its `[progress]` and `[metrics]` lines, and how fast it goes."""

    done: int = 0
    total: int | None = None
    unit: str = "step"
    first_seen: float | None = None  # when work was first reported (launch time excluded from rates)
    first_done: int = 0

    def update(self, done: int | None = None, total: int | None = None, unit: str | None = None) -> None:
        if total is not None:
            self.total = int(total)
        if unit:
            self.unit = str(unit)
        if done is not None:
            if self.first_seen is None:
                self.first_seen, self.first_done = time.monotonic(), int(done)
            self.done = max(self.done, int(done))

    def rate(self) -> float | None:
        """Units per second since work was first reported; None until there is one to say."""
        if self.first_seen is None or self.done <= self.first_done:
            return None
        elapsed = time.monotonic() - self.first_seen
        return (self.done - self.first_done) / elapsed if elapsed > 0 else None

    def eta_s(self) -> float | None:
        rate = self.rate()
        if rate is None or self.total is None:
            return None
        return max(0.0, (self.total - self.done) / rate)


@dataclass
class JobFailure:
    """Why a job failed, from its output: `reason` is what the operator reads first;
    `excerpt` the log lines that explain a crash (empty for a user error)."""

    reason: str
    excerpt: list[str]
    user_error: bool


class JobOutput:
    """Follows one job's output: its progress, each metric's first and last value, the user
    error it reported, and the recent lines that could explain a crash."""

    _KEEP = 400  # recent relevant lines (a traceback of each of several ranks fits)
    _MAX_ERROR_LINES = 50

    def __init__(self, stage: str, kind: str | None = None):
        self.user_error_prefixes = tuple(f"{p} failed: " for p in
                                         ([f"{stage} ({kind})", kind] if kind else []) + [stage])
        self.progress = JobProgress()
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.error_lines: list[str] = []
        self._error_rank: int | None = None  # the rank whose user error error_lines hold
        self._in_error = False
        self.relevant: deque[str] = deque(maxlen=self._KEEP)
        self.last_progress_at = time.monotonic()  # the job's start, then its last step / progress / heartbeat
        self.last_line: str | None = None
        self.tap: list[str] | None = None  # while set, every line is appended (pipeline.hang's stack dumps)
        self.launcher_verdict: str | None = None  # which worker failed first, when a launcher says

    def feed(self, raw: str) -> Line:
        line = classify(raw, self.user_error_prefixes)
        if self.tap is not None:
            self.tap.append(line.text)
        if line.kind in ("metrics", "progress", "heartbeat"):
            self.last_progress_at = time.monotonic()
        if line.kind != "blank":
            self.last_line = line.text
        if self._in_error:  # a user error's message continues until something else speaks
            if line.kind == "text" and not line.text.startswith(_TRACEBACK) \
                    and len(self.error_lines) < self._MAX_ERROR_LINES:
                self.error_lines.append(line.text)
                return Line("error", line.text)
            self._in_error = False
        if line.kind == "metrics":
            step = line.data.get("step")
            for k, v in line.data.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.first.setdefault(k, float(v))
                    self.last[k] = float(v)
            if isinstance(step, int) and step > 0:
                self.progress.update(done=step)
        elif line.kind == "progress":
            d = line.data
            self.progress.update(d.get("done") if isinstance(d.get("done"), int) else None,
                                 d.get("total") if isinstance(d.get("total"), int) else None, d.get("unit"))
        elif line.kind == "error":
            # rank 0's message, else the first rank's to speak (its peers often repeat it)
            if self._error_rank is None or (line.data["rank"] == 0 and self._error_rank != 0):
                self.error_lines, self._error_rank = [line.data["message"]], line.data["rank"]
                self._in_error = True
        elif line.kind in ("text", "warning"):
            self.relevant.append(line.text)
        elif line.kind == "launcher":
            self.launcher_verdict = line.data["message"]
        return line

    def failure(self, exit_code: int) -> JobFailure:
        """What to tell the operator about a job that exited with `exit_code`. A user error
        that a rank reported explains the failure whatever the code: the launcher may pass on
        the code of a peer rank that died of it."""
        if self.error_lines:
            return JobFailure("\n".join(self.error_lines).strip(), [], True)
        lines = list(self.relevant)
        blocks = [_traceback_block(lines, i) for i, t in enumerate(lines) if t.startswith(_TRACEBACK)]
        # the first crash is the cause: the peers that die after it (stopped by their
        # launcher, or losing their collective) print tracebacks of their own later
        # (with only such tracebacks, the cause printed none: the last lines say more)
        causes = [b for b in blocks if not _CONSEQUENCE.search(b[-1])]
        if self.launcher_verdict:  # the launcher knows which worker failed; the lines may be its peers'
            excerpt = causes[0][-FAILURE_LINES - 1:-1] if causes else lines[-FAILURE_LINES:]
            return JobFailure(f"{self.launcher_verdict} (exit code {exit_code})", excerpt, False)
        if causes:
            block = causes[0]
            return JobFailure(f"{block[-1]} (exit code {exit_code})", block[-FAILURE_LINES - 1:-1] or block, False)
        return JobFailure(f"its job exited with code {exit_code}", lines[-FAILURE_LINES:], False)


# exceptions a rank raises because another one failed first (or its launcher stopped it)
# (ProcessExitedException: pipeline.local_ranks' elastic agent reporting a rank's exit)
_CONSEQUENCE = re.compile(r"SignalException|ChildFailedError|ProcessExitedException|KeyboardInterrupt|DistBackendError|"
                          r"Connection (?:reset|closed) by peer|Broken pipe")


def _traceback_block(lines: list[str], start: int) -> list[str]:
    """The traceback starting at lines[start], up to its exception line."""
    block = lines[start:]
    end = next((i for i, t in enumerate(block) if i > 0 and not t.startswith((" ", "\t"))
                and t != _TRACEBACK), len(block) - 1)
    return block[:end + 1]
