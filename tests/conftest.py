"""Shared fixtures: a real S3 API (moto's server on 127.0.0.1) and the public benchmark sets.
(DeepSpeed's CPU ranks' /dev/shm workspaces are unlinked by the product itself:
stages/common/distributed.py, tests/stages/common/test_distributed_shm.py.)

The suite can run on pytest-xdist workers (`-n 3 --dist loadfile`: a file's tests share a worker,
so its module fixtures are built once); each worker has its own ports, tmp dirs and, below,
PREFECT_HOME."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from data_curation.benchmarks import BENCHMARKS_DIR_ENV, benchmarks_dir
from stages.common import extension_cache
from tests.suite_templates import RUN_SHARED, run_shared

REPO = Path(__file__).resolve().parent.parent
# CI's machines keep the public benchmark test sets (GSM8K, MATH-500, ...) beside the checkout; the
# project holds no copy. Tests read them through RING_BENCHMARKS_DIR, the setting an air-gapped
# cluster uses, which pytest_configure points here under CI; elsewhere those tests skip.
CI_BENCHMARKS = REPO.parent / "shared" / "benchmarks"
NO_BENCHMARKS = (f"{BENCHMARKS_DIR_ENV} is not set: the public benchmark test sets are not part of the project "
                 f"(set it to a directory holding gsm8k.jsonl, math500.jsonl, ...; CI points it at {CI_BENCHMARKS})")


@pytest.fixture(scope="session")
def benchmark_sets() -> Path:
    """The public benchmark test sets' directory (`<name>.jsonl` files); skips where none is given."""
    found = benchmarks_dir()
    if found is None:
        pytest.skip(NO_BENCHMARKS)
    return found

_PREFECT_HOME = pytest.StashKey[str]()  # this session's PREFECT_HOME (removed at its end)
_REPLACED = pytest.StashKey[dict]()  # the variables this session set: the values they had (None: unset)
# moto's test credentials, for the whole session (s3_server): no test reaches real AWS with the
# developer's own keys, and every test sees one environment whatever ran before it in its worker
# (set by the first S3 test, they gave the worker's later stage jobs a second warm job server)
TEST_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def pytest_configure(config):
    """Each worker (and a plain run) gets its own PREFECT_HOME: `ring-pipeline run`'s embedded
    server keeps its database there: the workers' servers would otherwise share one sqlite
    file, by default the user's own ~/.prefect/prefect.db. Set before any test imports Prefect; children inherit it.

    One intra-op thread per process unless OMP_NUM_THREADS says otherwise (set before any test
    imports torch; stage jobs inherit it, and pipeline.launch keeps a value that is set): the
    suite's processes share 2 cores (three workers, each often running a stage's ranks), and a
    second OpenMP thread on a busy core spins instead of helping the tiny models (the in-process
    torch tests took ~25% longer beside a 2-rank stage with torch's default of one thread per core)."""
    home = tempfile.mkdtemp(prefix=f"ring-prefect-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
    config.stash[_PREFECT_HOME] = home
    config.stash[_REPLACED] = {name: os.environ.get(name) for name in
                               ("PREFECT_HOME", "OMP_NUM_THREADS", extension_cache.VARIABLE, BENCHMARKS_DIR_ENV,
                                *TEST_AWS)}
    os.environ["PREFECT_HOME"] = home
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the test scripts that start DeepSpeed ranks of their own build its ops where the stages do
    extension_cache.use_environment_extension_dir()
    os.environ.update(TEST_AWS)
    if os.environ.get("CI") and not os.environ.get(BENCHMARKS_DIR_ENV) and CI_BENCHMARKS.is_dir():
        os.environ[BENCHMARKS_DIR_ENV] = str(CI_BENCHMARKS)
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the run's main process; its workers inherit it
        os.environ[RUN_SHARED] = tempfile.mkdtemp(prefix="ring-suite-")
        _compile_sources()


def _compile_sources() -> None:
    """The project's modules compiled to bytecode once, before any worker starts, where Python
    writes none by itself (PYTHONDONTWRITEBYTECODE, set in some CI images and containers): each
    of the suite's few hundred processes (stage ranks, launchers, orchestrators, verifier
    workers) would otherwise compile every module it imports again (~0.1-0.15 CPU-s a process;
    all of them: ~0.6 s here). What Python itself would write with bytecode on, into the
    checkout's __pycache__ dirs (git-ignored); a stale one is recompiled in memory as usual."""
    if not sys.flags.dont_write_bytecode:
        return  # each module is compiled by the first process that imports it, and kept
    import compileall

    for package in ("pipeline", "stages", "data_curation", "verifiers", "benchmarks", "tests"):
        compileall.compile_dir(REPO / package, quiet=2)


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # after every worker has finished
        from tests import prefect_api

        shared = Path(os.environ.pop(RUN_SHARED))
        prefect_api.stop(shared)
        shutil.rmtree(shared, ignore_errors=True)
    shutil.rmtree(config.stash[_PREFECT_HOME], ignore_errors=True)
    for name, value in config.stash[_REPLACED].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_collection_modifyitems(items):
    """Long files first: the file marked long_pole, then the files with slow tests, then the
    rest, each file's tests together and in their order (a stable sort by file). xdist hands
    out files in this order (pyproject: --no-loadscope-reorder; by default it orders files by
    their number of tests, which put the hundreds of quick tests first and the minutes-long
    files last), so the last files to run are short ones, and neither worker waits long for
    the other at the end."""
    long_pole = {item.path for item in items if item.get_closest_marker("long_pole")}
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in long_pole, item.path not in slow))


@pytest.fixture(scope="session")
def prefect_api() -> str:
    """The API URL of one Prefect server shared by every test of the run that needs a server but
    not a server of its own (tests/prefect_api.py): pass it as PREFECT_API_URL to a
    `ring-pipeline run`, or use `prefect_harness` (tests/e2e) for flows run in this process."""
    from tests import prefect_api as server

    return server.shared_api(run_shared())


@pytest.fixture(scope="session")
def prefect_template() -> Path:
    """The run's migrated Prefect database (tests/prefect_db.py): copy it into a PREFECT_HOME
    (`prefect_db.seed`) where a server will start, so that its start has no migrations to run."""
    from tests import prefect_db

    return prefect_db.template(run_shared())


@pytest.fixture(scope="session")
def embedded_prefect_home(prefect_template) -> Path:
    """This worker's PREFECT_HOME (pytest_configure) with a copy of `prefect_template`: for the
    tests whose `ring-pipeline run` starts its embedded server there."""
    from tests import prefect_db

    home = Path(os.environ["PREFECT_HOME"])
    prefect_db.seed(home, prefect_template)
    return home


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """No AWS credentials from anywhere (environment, files, instance metadata). The session's
    environment has moto's test credentials (TEST_AWS): with them, resolving a real s3:// URL
    (no network here) waits out botocore's retries."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def unreachable_port():
    """A loopback port nothing listens on for the whole test: reserved (stages.common.ports), so
    no other process of the machine starts listening there meanwhile."""
    from stages.common.ports import reserved_port

    with reserved_port() as port:
        yield port


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free loopback port; yields fsspec storage options for s3fs. The
    environment has its credentials for the whole session (TEST_AWS)."""
    from moto.server import ThreadedMotoServer

    from stages.common.ports import reserved_port

    with reserved_port() as port:  # until the server listens on it
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    endpoint = f"http://127.0.0.1:{port}"
    yield {"endpoint_url": endpoint, "key": TEST_AWS["AWS_ACCESS_KEY_ID"], "secret": TEST_AWS["AWS_SECRET_ACCESS_KEY"],
           "client_kwargs": {"region_name": TEST_AWS["AWS_DEFAULT_REGION"]}}
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket; yields (s3://bucket URL, storage options)."""
    import boto3

    name = f"ring-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server["endpoint_url"], aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=name)
    yield f"s3://{name}", dict(s3_server)
