"""Shared fixtures: a real S3 API (moto's server on 127.0.0.1), paths to shared data, and the
removal of the shared memory that DeepSpeed's CPU ranks leave behind."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_BENCHMARKS = REPO.parent / "shared" / "benchmarks"

# DeepSpeed's CPU backend gives every rank a 66 MB all-reduce workspace in /dev/shm and never
# unlinks it (shm.cpp defines shared_close() but nothing calls it). /dev/shm is RAM: over the
# suite's few dozen distributed stage runs that is gigabytes, and the 2-core CI machine starts
# evicting page cache (every later Python start reads torch from disk again).
DS_SHM = Path("/dev/shm")
DS_SHM_GLOB = "deepspeed_allreduce_buffer_*"


def _mapped_by_a_live_process() -> set[str]:
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(ln.split(maxsplit=5)[-1] for ln in maps.read_text().splitlines()
                          if DS_SHM_GLOB[:-1] in ln)
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    return mapped


@pytest.fixture(scope="session")
def _deepspeed_shm_before_the_suite() -> set[Path]:
    return set(DS_SHM.glob(DS_SHM_GLOB))


@pytest.fixture(autouse=True)
def _unlink_leaked_deepspeed_shm(_deepspeed_shm_before_the_suite):
    """After each test, unlink the workspaces that appeared since the suite began (in the test
    or in a fixture it used) and that no live process maps any more: their ranks have exited,
    while a job running elsewhere on the machine keeps its own."""
    yield
    new = set(DS_SHM.glob(DS_SHM_GLOB)) - _deepspeed_shm_before_the_suite
    if new:
        mapped = _mapped_by_a_live_process()
        for path in new:
            if str(path) not in mapped:
                path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free loopback port; yields fsspec storage options for s3fs."""
    from moto.server import ThreadedMotoServer

    from pipeline.launch import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in creds}
    os.environ.update(creds)
    endpoint = f"http://127.0.0.1:{port}"
    yield {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
           "client_kwargs": {"region_name": "us-east-1"}}
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket; yields (s3://bucket URL, storage options)."""
    import boto3

    name = f"ring-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server["endpoint_url"], aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
    yield f"s3://{name}", dict(s3_server)
