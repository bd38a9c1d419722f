"""The `_RUNNING` lease: one holder at a time, a clear message for the second, a dead
holder's lease taken over, and the old holder told it lost the lease."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pipeline.lease import RUNNING, LeaseHeld, is_live, read_lease, try_acquire


@pytest.fixture(params=["file", "s3", "memory"])
def stage_url(request, tmp_path):
    """A stage directory on each kind of backend: local lock, S3 conditional writes, and
    write-then-read-back (fsspec's in-memory store stands for any other store)."""
    if request.param == "s3":
        bucket, opts = request.getfixturevalue("s3_bucket")
        return f"{bucket}/recipe/sft-0123456789ab", opts
    if request.param == "memory":
        return f"memory://{tmp_path.name}/recipe/sft-0123456789ab", {}
    return f"file://{tmp_path}/recipe/sft-0123456789ab", {}


def test_one_holder_at_a_time_then_release(stage_url):
    url, opts = stage_url
    first = try_acquire(url, opts, 30, {"flow_run_id": "run-1"})
    try:
        with pytest.raises(LeaseHeld, match=r"running since \d{4}-\d\d-\d\d .* pid \d+, flow run run-1"):
            try_acquire(url, opts, 30, {"flow_run_id": "run-2"})
        first.update(run_id="mlflow-1")  # written at once, for status and a later takeover
        held = read_lease(url, opts)
        assert held["owner"] == first.owner and held["run_id"] == "mlflow-1" and is_live(held)
    finally:
        first.release()
    assert read_lease(url, opts) is None
    second = try_acquire(url, opts, 30, {})
    second.release()


def test_heartbeat_keeps_a_lease_alive_and_a_stale_one_is_taken_over(stage_url):
    url, opts = stage_url
    holder = try_acquire(url, opts, 0.8, {"flow_run_id": "alive"})
    try:
        beat = read_lease(url, opts)["heartbeat"]
        time.sleep(1.2)  # longer than the timeout: only the heartbeats keep it
        assert read_lease(url, opts)["heartbeat"] > beat
        with pytest.raises(LeaseHeld):
            try_acquire(url, opts, 0.8, {})
        # the holder's process hangs (its heartbeat stops) without dying
        holder._stop.set()
        holder._thread.join()
        time.sleep(1.0)
        assert not is_live(read_lease(url, opts))
        new = try_acquire(url, opts, 30, {"flow_run_id": "new"})
        assert new.taken_over["flow_run_id"] == "alive"
        # the old holder finds out at its next heartbeat; its job must stop
        holder._heartbeat()
        assert holder.lost and "taken over" in holder.lost and "flow run new" in holder.lost
        holder.release()  # releasing a lost lease leaves the new holder's alone
        assert read_lease(url, opts)["owner"] == new.owner
        new.release()
    finally:
        holder._stop.set()


def test_a_killed_holder_on_this_host_is_taken_over_at_once(tmp_path):
    url = f"file://{tmp_path}/recipe/base-0123456789ab"
    script = ("import sys; from pipeline.lease import try_acquire; "
              "try_acquire(sys.argv[1], {}, 3600, {}); print('held', flush=True)")
    out = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "held", out.stderr
    dead = read_lease(url, {})
    assert dead["heartbeat"] > time.time() - 60  # fresh, but its process is gone
    assert not is_live(dead)
    lease = try_acquire(url, {}, 3600, {})
    assert lease.taken_over["pid"] == dead["pid"]
    lease.release()


def test_a_torn_lease_file_is_stale_not_a_crash(tmp_path):
    stage = tmp_path / "recipe" / "sft-0123456789ab"
    stage.mkdir(parents=True)
    (stage / RUNNING).write_text('{"owner": "x", "heartbe')  # a writer died mid-write
    lease = try_acquire(f"file://{stage}", {}, 30, {})
    assert lease.taken_over.get("corrupt")
    assert json.loads((stage / RUNNING).read_text())["owner"] == lease.owner
    lease.release()
