"""The live console (rich progress bars) with stages running in parallel threads, as the
Prefect task threads drive it."""
from __future__ import annotations

import io
import threading

from pipeline.console import RunConsole, Verbosity, installed
from pipeline.job_output import JobOutput


def _drive(show: RunConsole, stage: str, steps: int) -> None:
    output = JobOutput(stage, "sft")
    show.stage_started(stage, "sft, deepspeed on 2 ranks")
    for raw in [f'[progress] {{"done": 0, "total": {steps}}}'] + \
               [f'[metrics] {{"step": {s}, "loss": {10 - s / 10}}}' for s in range(1, steps + 1)]:
        show.stage_output(stage, "sft", output.feed(raw), output)
    assert output.progress.done == steps


def test_parallel_stages_on_live_bars():
    out = io.StringIO()
    with installed(RunConsole(Verbosity.NORMAL, live=True, out=out, err=out)) as show:
        workers = [threading.Thread(target=_drive, args=(show, name, 200)) for name in ("sft", "reward_model")]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        show.stage_finished("sft", "done in 1.0s  loss 9.9 -> 8  -> file:///store/sft-1")
        show.stage_failed("reward_model", "user error (exit code 2): prefs.jsonl:4: no `chosen`\nlog: /w/rm.log")
    text = out.getvalue()
    assert "sft            done in 1.0s  loss 9.9 -> 8  -> file:///store/sft-1" in text
    assert "reward_model   FAILED    user error (exit code 2): prefs.jsonl:4: no `chosen`" in text
    assert "               log: /w/rm.log" in text
    assert "[metrics]" not in text
