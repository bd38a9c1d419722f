"""CPU ranks forked from one warm launcher (pipeline.local_ranks), through the public launch
path (every 2-rank stage test runs through it to the end): a rank killed outright (it prints
nothing, its peer dies of losing it) is the one the launcher names, with its signal as the
exit status; a rank's user error is the stage's message. Bounded time, no rank left behind."""
from __future__ import annotations

import time

import pytest

from pipeline.launch import launch_command, launch_job
from stages.common.contract import Resources, StageFailed, StageJob
from tests.live_processes import running_below_us

pytestmark = pytest.mark.slow
PROBE = "tests.pipeline.rank_kill_probe"
TWO = Resources(cpu_ranks=2)


def _launch(tmp_path, die: str):
    job = StageJob(recipe="t", stage="probe", kind="probe", hash="0" * 16, config={"kind": "probe", "die": die},
                   stage_url="file:///x", output_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "work"))
    job.write(tmp_path / "job.json")
    log = tmp_path / "stage.log"
    with launch_command(PROBE, tmp_path / "job.json", TWO, "deepspeed", True) as command:
        assert command[1:3] == ["-m", "pipeline.local_ranks"]
        return launch_job(command, "probe", log, TWO, kind="probe"), log


def _no_rank_left() -> None:
    time.sleep(0.5)
    left = running_below_us(PROBE)
    assert not left, left


def test_a_killed_rank_is_named_and_its_signal_is_the_exit_status(tmp_path):
    started = time.monotonic()
    with pytest.raises(StageFailed) as failed:
        _launch(tmp_path, "kill")
    assert time.monotonic() - started < 90
    assert failed.value.exit_code == 128 + 9 and not failed.value.user_error
    # rank 0 dies too (its all-reduce loses its peer), usually within elastic's poll: still rank 1 is named
    assert "local_ranks: rank 1 (pid " in (tmp_path / "stage.log").read_text()
    assert "failed first (killed by signal SIGKILL)" in (tmp_path / "stage.log").read_text()
    _no_rank_left()


def test_a_ranks_user_error_is_the_stages_message(tmp_path):
    with pytest.raises(StageFailed) as failed:
        _launch(tmp_path, "user_error")
    # (the exit status may be rank 0's, which lost its peer at the same moment: the message decides)
    assert failed.value.user_error and failed.value.exit_code in (1, 2)
    assert "[rank 1] the probe's shard 3 is missing" in failed.value.reason
    assert "found in sys.modules" not in (tmp_path / "stage.log").read_text()  # runpy's warning of a warm entry
    _no_rank_left()
