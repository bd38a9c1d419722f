"""A training stage's optional torch.profiler window (the `profile` setting): rank 0's optimizer
steps start_step .. start_step + steps - 1 run under torch.profiler, and their operator table
(key_averages, sorted by device time; CPU time without CUDA) and a chrome trace are written to
a local directory. Cosmetic: it changes how fast a step runs, never what it computes.
torch is imported where it is used: ProfileSettings is part of the SFT config, which every
recipe validation imports."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from stages.common.contract import Strict

TABLE_ROWS = 40


class ProfileSettings(Strict):
    start_step: int = Field(ge=1, description="the first optimizer step profiled (1 = the first step; "
                                              "later steps skip warm-up and compilation)")
    steps: int = Field(1, ge=1, le=50, description="optimizer steps profiled (a trace grows with each)")


class StepProfiler:
    """Call `before(step)` / `after(step)` around each optimizer step (1-based numbers); inactive
    (every call a no-op) without settings or off rank 0."""

    def __init__(self, settings: ProfileSettings | None, out_dir: Path, active: bool):
        self.settings = settings if active else None
        self.out_dir = out_dir
        self._prof = None

    @property
    def table_path(self) -> Path:
        return self.out_dir / "profile_table.txt"

    @property
    def trace_path(self) -> Path:
        return self.out_dir / "profile_trace.json"

    def before(self, step: int) -> None:
        if self.settings is None or step != self.settings.start_step:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.start()

    def after(self, step: int, last: bool = False) -> Path | None:
        """The table's path once the window's last step ended (or the run's `last` step, when the
        run ends inside the window), else None."""
        if self._prof is None or (step != self.settings.start_step + self.settings.steps - 1 and not last):
            return None
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()  # the window's kernels belong to it
        self._prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = self._prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
        header = (f"torch.profiler: optimizer steps {self.settings.start_step}.."
                  f"{step} of rank 0, sorted by {sort_by}\n")
        self.table_path.write_text(header + table + "\n")
        self._prof.export_chrome_trace(str(self.trace_path))
        self._prof = None
        return self.table_path
