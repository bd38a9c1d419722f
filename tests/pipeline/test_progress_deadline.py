"""No silent hang: a job past its progress deadline has its ranks' stacks dumped into its log,
is stopped, and fails naming the rank that stalls and where each rank is; a store write that
never returns fails within its timeout, naming the write (issue 37)."""
from __future__ import annotations

import time

import pytest

from pipeline.job_output import JobOutput
from pipeline.launch import launch_command, launch_job
from stages.common.artifact_inputs import StorageError
from stages.common.checkpoint_store import CheckpointStore
from stages.common.contract import Resources, StageFailed, StageJob
from stages.common.store_writes import WritePolicy
from tests.store_faults import StallingS3


@pytest.mark.slow
def test_a_rank_blocked_in_a_collective_fails_the_stage_within_its_deadline(tmp_path):
    job = StageJob(recipe="t", stage="hang", kind="probe", hash="0" * 16, config={"kind": "probe"},
                   stage_url="file:///x", output_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "work"))
    job_path = tmp_path / "job.json"
    job.write(job_path)
    resources = Resources(cpu_ranks=2)
    log = tmp_path / "stage.log"
    # The deadline counts from launch, and the warm launcher's imports come first (~10 s on a quiet
    # 2-core machine; over 20 s under the suite's load, when no rank was up to dump): 60 s leaves
    # the ranks time to start, and the test waits, it does not spin.
    deadline_s = 60
    started = time.monotonic()
    with launch_command("tests.pipeline.hang_probe", job_path, resources, "torchrun", True) as command, \
            pytest.raises(StageFailed) as e:
        launch_job(command, "hang", log, resources, progress_deadline_s=deadline_s)
    took = time.monotonic() - started
    reason = e.value.reason
    assert not e.value.user_error  # a hang is retried like a crash (the retry resumes from a checkpoint)
    assert "no progress for" in reason and f"progress deadline {deadline_s} s" in reason, reason
    assert "rank 1 is outside any collective (its peers wait for it): in stall_forever (hang_probe.py:" in reason
    assert "rank 0: in all_reduce" in reason, reason
    assert "last line of the job: rank 1: loading a shard that never arrives" in reason, reason
    text = log.read_text()
    for rank in (0, 1):  # each rank's dump, labelled, in the log
        assert f"the stacks of rank {rank} (pid" in text
    assert text.count("most recent call first") >= 2
    assert took < deadline_s + 60, took  # the start, the deadline, the dumps, SIGINT -> SIGTERM -> SIGKILL


def test_progress_lines_and_heartbeats_reset_the_deadline():
    out = JobOutput("s", "sft")
    t0 = out.last_progress_at
    time.sleep(0.01)
    out.feed("some chatter\n")
    assert out.last_progress_at == t0 and out.last_line == "some chatter"
    for line in ('[metrics] {"step": 1, "loss": 2.0}\n', '[progress] {"done": 2}\n', "[heartbeat] decoding\n"):
        before = out.last_progress_at
        time.sleep(0.01)
        out.feed(line)
        assert out.last_progress_at > before, line


def test_a_checkpoint_write_that_never_returns_fails_within_its_timeout(tmp_path, s3_bucket):
    bucket_url, opts = s3_bucket
    proxy = StallingS3(opts["endpoint_url"])
    options = {**opts, "endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "model.bin").write_bytes(b"x" * 1024)
    store = CheckpointStore(f"{bucket_url}/runs/s-0123", options, writes=WritePolicy(timeout_s=2, attempts=2,
                                                                                     backoff_s=0.1))
    started = time.monotonic()
    with pytest.raises(StorageError) as e:
        store.save(local, 7)
    took = time.monotonic() - started
    message = str(e.value)
    assert "upload checkpoint step 7's model.bin to" in message and f"{bucket_url}/runs/s-0123" in message
    assert "no answer within 2 s (tried 2 times)" in message, message
    assert proxy.stalled == 2 and took < 2 * 2 + 5, took
