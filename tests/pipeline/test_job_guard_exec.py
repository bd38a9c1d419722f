"""`python -m pipeline.job_guard --exec PARENT -- CMD`: CMD itself (no guard process in between,
which Ray would SIGKILL with the actor and leave CMD running), killed when PARENT dies, kill -9
included; a parent already gone is not waited for."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")

# a parent that starts the guarded command and prints the command's pid, then waits
_PARENT = textwrap.dedent("""\
    import os, subprocess, sys, time
    cmd = [sys.executable, "-m", "pipeline.job_guard", "--exec", str(os.getpid()), "--",
           sys.executable, "-c", "import time; time.sleep(600)"]
    child = subprocess.Popen(cmd)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def test_the_command_dies_with_its_parent_and_is_the_child_itself():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()}, start_new_session=True)
    child = psutil.Process(int(parent.stdout.readline()))
    deadline = time.time() + 30
    while child.cmdline()[1:] != ["-c", "import time; time.sleep(600)"]:  # exec'd: the guard became it
        assert time.time() < deadline, child.cmdline()
        time.sleep(0.05)
    try:
        assert child.ppid() == parent.pid
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        child.wait(timeout=10)  # raises if it outlives its parent
    finally:
        for p in (parent, child):
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                p.kill()


def test_a_parent_already_gone_is_not_waited_for():
    out = subprocess.run([sys.executable, "-m", "pipeline.job_guard", "--exec", "1", "--", "sleep", "600"],
                         timeout=30)
    assert out.returncode == 1  # pid 1 is not this process's parent: the command never starts
