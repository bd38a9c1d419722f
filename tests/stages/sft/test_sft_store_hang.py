"""A checkpoint write that never returns fails the training stage within the store's write
timeout, naming the write; nothing is published (issue 37: no silent hang)."""
from __future__ import annotations

import time

import pytest

from pipeline.execute import run_stage
from stages.common.contract import StageFailed
from stages.common.store_writes import WritePolicy
from tests.stages.conftest import ONE
from tests.store_faults import StallingS3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_write_that_never_returns_fails_the_stage(stage_env, data_dir, base_dir, s3_bucket):
    bucket_url, opts = s3_bucket
    proxy = StallingS3(opts["endpoint_url"])
    options = {**opts, "endpoint_url": proxy.url, "config_kwargs": {"retries": {"max_attempts": 1}}}
    # the model and data as local inputs: the stage's own store is the stalling S3
    config = {"model": str(base_dir), "data": str(data_dir / "sft.jsonl"), "max_seq_len": 128,
              "max_steps": 3, "warmup_steps": 1, "micro_batch_size": 2, "zero_stage": 0, "checkpoint_every": 1}
    started = time.monotonic()
    with pytest.raises(StageFailed) as e:
        run_stage("sft", config, stage="sft-stall", storage=f"{bucket_url}/runs", storage_options=options,
                  resources=ONE,
                  launcher="local", work_root=stage_env["work_root"],
                  writes=WritePolicy(timeout_s=3, attempts=2, backoff_s=0.1))
    assert not e.value.user_error  # retryable: a Prefect retry resumes from the last complete checkpoint
    assert "StorageError: cannot upload checkpoint step 1's" in e.value.reason, e.value.reason
    assert "no answer within 3 s (tried 2 times)" in e.value.reason, e.value.reason
    assert proxy.stalled == 2
    assert time.monotonic() - started < 240
