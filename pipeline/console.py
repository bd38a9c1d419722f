"""What a run prints: per stage one start line, one live progress line, one finish line with
its headline numbers; a failure once, in full. Everything a stage job prints goes to its
log (and metrics to MLflow); the console shows it only when asked.

Three levels:
- quiet: start, finish and failure lines;
- normal: also each running stage's progress (steps done, rate, ETA, its main number) and
  the warnings its job prints (`name: warning: ...`);
- verbose: also every line of every stage job, prefixed with its stage, and Prefect's logs.

On a terminal the progress lines are rich progress bars, one per running stage, redrawn in
place; elsewhere (CI, a pipe, a file) a plain line per stage at each quarter of its work, or
every `PLAIN_EVERY_S` when its total is unknown or the quarter is slow to come.

Stages run in parallel worker threads: every method may be called from any thread.
"""
from __future__ import annotations

import contextlib
import enum
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Iterator

from pipeline.job_output import JobOutput, Line
from pipeline.stage_metrics import kind_metrics
from stages.common import secrets

PLAIN_EVERY_S = 60.0
_NAME_WIDTH = 14


class Verbosity(enum.IntEnum):
    QUIET = 0
    NORMAL = 1
    VERBOSE = 2


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def rate_text(rate: float, unit: str) -> str:
    """`2.5 step/s`, or for slow work `12 s/step`."""
    if rate >= 1:
        return f"{rate:,.0f} {unit}/s" if rate >= 100 else f"{rate:.3g} {unit}/s"
    return f"{1 / rate:.3g} s/{unit}" if rate > 0 else ""


def _current_number(kind: str | None, output: JobOutput) -> str:
    """The latest value of the kind's first headline metric, e.g. `loss 1.013`."""
    for curve in kind_metrics(kind).headline[:1]:
        name = curve.find(output.last)
        if name is not None:
            return f"{curve.name} {output.last[name]:.4g}"
    return ""


@dataclass
class _PlainProgress:
    printed_at: float
    quarter: int = 0


class RunConsole:
    def __init__(self, verbosity: Verbosity = Verbosity.NORMAL, live: bool | None = None,
                 out: IO[str] | None = None, err: IO[str] | None = None):
        self.verbosity = verbosity
        self._out, self._err = out, err
        is_tty = getattr(self.out, "isatty", lambda: False)()
        self.live = (is_tty if live is None else live) and verbosity >= Verbosity.NORMAL
        self._lock = threading.RLock()
        self._bars = None  # rich.progress.Progress while stages run (live mode)
        self._tasks: dict[str, int] = {}
        self._plain: dict[str, _PlainProgress] = {}

    @property
    def out(self) -> IO[str]:
        return self._out or sys.stdout  # looked up when used: tests and Prefect swap sys.stdout

    @property
    def err(self) -> IO[str]:
        return self._err or sys.stderr

    # -- lines -----------------------------------------------------------------------------
    def say(self, text: str, error: bool = False) -> None:
        """A line of its own (above the progress bars)."""
        text = secrets.redact(text)
        with self._lock:
            if self._bars is not None:
                self._bars.console.print(text, markup=False, highlight=False, style="red" if error else None)
                return
            stream = self.err if error else self.out
            stream.write(text + "\n")
            stream.flush()

    def _stage_line(self, stage: str, text: str, error: bool = False) -> None:
        self.say(f"{stage:<{_NAME_WIDTH}} {text}", error)

    # -- a stage's life --------------------------------------------------------------------
    def stage_started(self, stage: str, what: str) -> None:
        self._stage_line(stage, f"started   {what}")
        with self._lock:
            if self.live:
                self._bar_for(stage)
            else:
                self._plain[stage] = _PlainProgress(time.monotonic())

    def stage_note(self, stage: str, text: str) -> None:
        """Something the pipeline does for the stage (waiting for another run, taking over)."""
        self._stage_line(stage, text)

    def stage_output(self, stage: str, kind: str | None, line: Line, output: JobOutput) -> None:
        """One line of the stage job's output, already parsed into `output`."""
        if self.verbosity >= Verbosity.VERBOSE and line.kind != "blank":
            text = line.text if line.text.startswith(f"[{stage}]") else f"[{stage}] {line.text}"
            self.say(text)
        elif line.kind == "warning" and self.verbosity >= Verbosity.NORMAL:
            self._stage_line(stage, line.text)
        if line.kind in ("metrics", "progress") and self.verbosity >= Verbosity.NORMAL:
            self._show_progress(stage, kind, output)

    def stage_finished(self, stage: str, text: str) -> None:
        self._end_progress(stage)
        self._stage_line(stage, text)

    def stage_failed(self, stage: str, report: str, verdict: str = "FAILED") -> None:
        """`report` (pipeline.failures) under the stage's name; `verdict` says what happened."""
        self._end_progress(stage)
        first, *rest = report.splitlines() or [""]
        self._stage_line(stage, f"{verdict:<9} {first}", error=True)
        for line in rest:
            self.say(" " * (_NAME_WIDTH + 1) + line, error=True)

    def close(self) -> None:
        with self._lock:
            if self._bars is not None:
                self._bars.stop()
                self._bars, self._tasks = None, {}

    # -- progress --------------------------------------------------------------------------
    def _bar_for(self, stage: str) -> int:
        if self._bars is None:
            self._bars = _progress_bars(self.out)
            self._bars.start()
        if stage not in self._tasks:
            self._tasks[stage] = self._bars.add_task(stage, total=None, unit="step", number="")
        return self._tasks[stage]

    def _show_progress(self, stage: str, kind: str | None, output: JobOutput) -> None:
        p = output.progress
        number = _current_number(kind, output)
        with self._lock:
            if self.live:
                self._bars.update(self._bar_for(stage), completed=p.done, total=p.total, unit=p.unit,
                                  number=number)
                return
            state = self._plain.setdefault(stage, _PlainProgress(time.monotonic()))
            quarter = 4 * p.done // p.total if p.total else 0
            now = time.monotonic()
            if not (state.quarter < quarter < 4 or now - state.printed_at >= PLAIN_EVERY_S):
                return
            state.quarter, state.printed_at = max(state.quarter, quarter), now
        parts = [f"{p.done}/{p.total} {p.unit}s ({100 * p.done // p.total}%)" if p.total
                 else f"{p.done} {p.unit}s"]
        rate, eta = p.rate(), p.eta_s()
        if rate is not None:
            parts.append(rate_text(rate, p.unit))
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        if number:
            parts.append(number)
        self._stage_line(stage, "  ".join(parts))

    def _end_progress(self, stage: str) -> None:
        with self._lock:
            self._plain.pop(stage, None)
            task = self._tasks.pop(stage, None)
            if task is not None and self._bars is not None:
                self._bars.remove_task(task)


def _progress_bars(out: IO[str]):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Count(ProgressColumn):
        def render(self, task) -> Text:
            done, unit = int(task.completed), task.fields["unit"]
            if task.total is not None:
                return Text(f"{done}/{int(task.total)} {unit}s", style="progress.download")
            return Text(f"{done} {unit}s" if done else "", style="progress.download")

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(rate_text(speed, task.fields["unit"]) if speed else "", style="progress.data.speed")

    class Remaining(ProgressColumn):
        def render(self, task) -> Text:
            left = task.time_remaining
            return Text(f"ETA {_duration(left)}" if left is not None else "", style="progress.remaining")

    return Progress(TextColumn(f"{{task.description:<{_NAME_WIDTH}}}"), BarColumn(bar_width=30), Count(),
                    Rate(), TimeElapsedColumn(), Remaining(), TextColumn("{task.fields[number]}"),
                    console=Console(file=out), redirect_stdout=True, redirect_stderr=True)


_current = RunConsole(live=False)


def current() -> RunConsole:
    """The console of this process's run (a plain, normal one unless `installed`)."""
    return _current


@contextlib.contextmanager
def installed(console: RunConsole) -> Iterator[RunConsole]:
    global _current
    previous, _current = _current, console
    try:
        yield console
    finally:
        console.close()
        _current = previous
