"""The per-step metrics of a stage that is still running, read from its stage log: the
`[metrics]` lines its job prints (stages/common/stage_log.py, read by
pipeline/job_output.py), which the pipeline writes to the attempt's `stage.log` as they come.
A stage's `metrics.jsonl` exists only once it publishes; a benchmark that writes its curves
from these lines as it goes still has them when its runs are cut off (a device session's
time ending, a job's timeout).
"""
from __future__ import annotations

from pathlib import Path

from pipeline.job_output import classify


def stage_log(work_root: Path, recipe: str, stage: str) -> Path | None:
    """The newest attempt's log of `stage` run under `work_root` (pipeline/execute.py's layout:
    <work_root>/<recipe>/<stage>-<hash[:12]>/<attempt>/stage.log); None before it starts."""
    logs = [p for p in Path(work_root).glob(f"{recipe}/{stage}-*/*/stage.log") if p.is_file()]
    return max(logs, key=lambda p: p.stat().st_mtime) if logs else None


def logged_metrics(path: Path | None) -> list[dict[str, float]]:
    """One dict per step, in step order, from a stage log's `[metrics]` lines; a step logged
    again (a resumed attempt) keeps its last line. A line still being written is skipped."""
    if path is None or not path.exists():
        return []
    by_step: dict[int, dict[str, float]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = classify(raw)
            step = line.data.get("step") if line.kind == "metrics" else None
            if isinstance(step, int):
                by_step[step] = line.data
    return [by_step[s] for s in sorted(by_step)]
