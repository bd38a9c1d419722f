"""The verifier pool starts whatever TMPDIR is: its forkserver's AF_UNIX socket goes under
multiprocessing's temp dir, a socket path holds at most 107 bytes, and a scheduler's per-job
TMPDIR can be longer (verifiers/mp_tempdir.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import verifiers

PROJECT = Path(verifiers.__file__).resolve().parents[1]

_POOL = textwrap.dedent('''
    import multiprocessing.util, os, sys, tempfile
    import verifiers.mp_tempdir as mp_tempdir
    from verifiers import verify_batch
    if len(sys.argv) > 1:
        mp_tempdir.SHORT_BASES = (sys.argv[1],)  # no short dir on this machine
    row = {"domain": "math", "reference": {"answer": "5"}}
    out = verify_batch([row, row], ["\\\\boxed{5}", "\\\\boxed{6}"], num_workers=2, timeout_s=30)
    print([r.score for r in out], multiprocessing.util.get_temp_dir(), tempfile.gettempdir())
''')

_BARE_FORKSERVER = textwrap.dedent('''
    import multiprocessing as mp
    p = mp.get_context("forkserver").Process(target=print)
    p.start(); p.join()
''')


@pytest.fixture
def long_tmpdir():
    top = Path(tempfile.mkdtemp(prefix="ring-long-", dir="/tmp"))
    long = top / ("d" * (150 - len(str(top)) - 1))
    long.mkdir(mode=0o700)
    assert len(str(long)) == 150
    yield long
    shutil.rmtree(top, ignore_errors=True)


def _run(code: str, tmpdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "TMPDIR": str(tmpdir)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env=env, check=False)


def test_the_pool_starts_under_a_150_byte_tmpdir_and_cleans_its_short_dir(long_tmpdir):
    if sys.version_info < (3, 14):  # the failure this guards against (3.14 falls back by itself)
        bare = _run(_BARE_FORKSERVER, long_tmpdir)
        assert bare.returncode != 0 and "AF_UNIX path too long" in bare.stderr, bare.stderr[-2000:]
    done = _run(_POOL, long_tmpdir)
    assert done.returncode == 0, done.stderr[-2000:]
    scores, socket_dir, tmp = done.stdout.strip().rsplit(" ", 2)
    assert scores == "[1.0, 0.0]", done.stdout
    assert tmp == str(long_tmpdir)  # everything else still uses the job's TMPDIR
    assert socket_dir.startswith(("/tmp/pymp-", "/var/tmp/pymp-", "/dev/shm/pymp-")), socket_dir
    assert not os.path.exists(socket_dir)  # removed at exit
    assert list(long_tmpdir.iterdir()) == []


def test_no_short_dir_anywhere_is_an_error_naming_tmpdir(long_tmpdir):
    done = _run(_POOL, long_tmpdir, str(long_tmpdir))
    assert done.returncode != 0
    assert "VerifierPoolError: the verifier pool's sockets go under the temp dir" in done.stderr, done.stderr[-2000:]
    assert str(long_tmpdir) in done.stderr and "set TMPDIR to a dir of at most 75 bytes" in done.stderr
