"""One memory limit per program, and sandboxes under private temp dirs: attacks by category.

Every memory attack runs in the mode this machine gives (a cgroup where one can be made)
and in the fail-closed fallback (``RING_SANDBOX_MEMORY=rlimit``: nproc processes of
memory_mb // nproc each). A program spreads CHUNK MiB pieces over several children (or
threads, shared mappings, exec'd interpreters, tmpfs files) that each stay within any
per-process limit but together hold far more than ``memory_mb``; it reports how many
pieces were held at once, and the test checks that never exceeds the program's bound.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from verifiers import sandbox_limits, verify
from verifiers.sandbox import (
    SandboxConfig,
    SandboxUnavailable,
    isolation_mode,
    run_python,
    sandbox_info,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("sandbox")]
PROJECT = Path(__file__).resolve().parents[2]
CHUNK, PIECES = 100, 6  # MiB per piece; 600 MiB attempted
CFG = {"memory_mb": 320, "nproc": 8, "wall_s": 30}  # 40 MiB per process in rlimit mode

# each way to hold a piece: the body of `hold()`, which returns when it holds CHUNK MiB
HOLD = {
    "fork_children": "b = bytearray(CHUNK << 20); b[::4096] = b'x' * len(b[::4096])",
    "shared_mmap": "m = mmap.mmap(-1, CHUNK << 20, flags=mmap.MAP_SHARED)\n"
                   "for i in range(0, CHUNK << 20, 4096): m[i] = 1",
    "tmpfs_files": "f = open('/tmp/piece%d' % os.getpid(), 'wb')\n"
                   "for _ in range(CHUNK): f.write(b'x' * (1 << 20))\nf.flush()",
    "exec_interpreter": "os.execv(sys.executable, [sys.executable, '-c', 'import time; b = bytearray(%d << 20); "
                        "b[::4096] = b\"x\" * len(b[::4096]); time.sleep(1.5)' % CHUNK])",
}
SPREAD = '''
import json, mmap, os, sys, threading, time
CHUNK, PIECES = {chunk}, {pieces}
def hold():
{hold}
    time.sleep(1.5)  # all pieces are held at the same time
def in_child():
    pid = os.fork()
    if pid == 0:
        try:
            hold()
            os._exit(0)
        except BaseException:
            os._exit(3)
    return pid
held = 0
if {threads}:
    ok = []
    def piece():
        try:
            hold()
            ok.append(1)
        except BaseException:
            pass
    ts = []
    for _ in range(PIECES):
        try:
            ts.append(threading.Thread(target=piece))
            ts[-1].start()
        except RuntimeError:
            ts.pop()
    for t in ts:
        t.join()
    held = len(ok)
else:
    pids = []
    for _ in range(PIECES):
        try:
            pids.append(in_child())
        except OSError:
            pass
    held = sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in pids)
print(json.dumps({{"held": held}}))
'''


def spread(how: str) -> str:
    threads = how == "threads"
    body = HOLD["fork_children" if threads else how]
    return SPREAD.format(chunk=CHUNK, pieces=PIECES, threads=threads, hold=textwrap.indent(body, "    "))


@pytest.fixture(params=["auto", "rlimit"])
def memory_mode(request, monkeypatch):
    assert isolation_mode() == "ns"
    monkeypatch.setenv(sandbox_limits.MODE_ENV, request.param)
    return sandbox_info()["memory"]


@pytest.mark.parametrize("how", [*HOLD, "threads"])
def test_pieces_held_at_once_stay_within_the_programs_limit(memory_mode, how):
    cfg = SandboxConfig(**CFG)
    r = run_python({"main.py": spread(how)}, "main.py", config=cfg)
    assert r.memory_mode == memory_mode and not r.timed_out
    lines = r.stdout.decode().strip().splitlines()
    held = json.loads(lines[-1])["held"] if r.returncode == 0 and lines else 0  # killed whole: held nothing
    assert held * CHUNK <= cfg.memory_bound_mb(memory_mode), (held, r.stderr.decode(errors="replace")[-500:])
    if memory_mode != "rlimit" and how not in ("threads", "tmpfs_files"):
        # processes that each fit RLIMIT_AS: the kernel stopped them at the program's limit, and
        # says so (threads meet their process's RLIMIT_AS first; files meet the tmpfs cap)
        assert r.memory_exceeded


def test_no_part_of_the_program_goes_on_past_its_limit(memory_mode):
    # children report each piece once it is held and keep it: when one more piece is over
    # the limit, no process may go on (killing one and letting the rest run on would let
    # the sum of their reports exceed the limit)
    r = run_python({"main.py": textwrap.dedent(f'''
        import os, time
        for k in range({PIECES}):
            if os.fork() == 0:
                try:
                    b = bytearray({CHUNK} << 20)
                    b[::4096] = b"x" * len(b[::4096])
                    os.write(1, b"held\\n")
                    time.sleep(20)
                except MemoryError:
                    pass
                os._exit(0)
            time.sleep(0.4)
        print("parent went on")
    ''')}, "main.py", config=SandboxConfig(**{**CFG, "wall_s": 8}))
    held = r.stdout.count(b"held\n")
    assert held * CHUNK <= SandboxConfig(**CFG).memory_bound_mb(memory_mode)
    if memory_mode != "rlimit":
        assert r.memory_exceeded and b"parent went on" not in r.stdout and not r.timed_out


def test_a_program_that_closed_its_output_is_still_stopped_at_its_limit():
    if sandbox_info()["memory"] == "rlimit":
        pytest.skip("no cgroup on this machine")
    t0 = time.monotonic()
    r = run_python({"main.py": "import os\nos.close(1)\nos.close(2)\n" + spread("fork_children")}, "main.py",
                   config=SandboxConfig(**CFG))
    assert r.memory_exceeded and not r.timed_out and time.monotonic() - t0 < 15


def test_a_cheat_that_needs_more_than_its_limit_scores_zero(memory_mode):
    # prints the right answer only if every child got its memory: the output must not count
    program = spread("fork_children").replace('print(json.dumps({"held": held}))',
                                              'print(42 if held == PIECES else 0)')
    row = {"domain": "code", "reference": {"tests": [{"input": "", "output": "42"}], "memory_mb": CFG["memory_mb"],
                                           "timeout_s": 20}}
    r = verify(row, f"```python\n{program}\n```", timeout_s=60)
    assert r.score == 0 and r.details["sandbox"]["memory"] == memory_mode


def test_memory_in_no_address_space_is_refused(memory_mode):
    # memfd pages and SysV segments (after shmdt) are in no address space (RLIMIT_AS) and no
    # size-capped tmpfs
    r = run_python({"main.py": textwrap.dedent('''
        import ctypes, os
        try:
            fd = os.memfd_create("hoard")
            os.write(fd, b"x" * (1 << 20))
            print("memfd held")
        except OSError as e:
            print("memfd refused", e.errno)
        libc = ctypes.CDLL(None, use_errno=True)
        shmid = libc.shmget(0, 1 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        print("shm held" if shmid >= 0 else "shm refused %d" % ctypes.get_errno())
    ''')}, "main.py")
    assert r.stdout == b"memfd refused 1\nshm refused 1\n", r.stdout + r.stderr


def test_fork_bomb_of_small_processes_stops_at_nproc(memory_mode):
    # each process is tiny (within any per-process limit); their number is what is bounded
    r = run_python({"main.py": textwrap.dedent('''
        import json, os, threading, time
        forked, threads = 0, 0
        for _ in range(64):
            try:
                if os.fork() == 0:
                    time.sleep(3)
                    os._exit(0)
                forked += 1
            except OSError:
                break
        for _ in range(64):
            try:
                threading.Thread(target=time.sleep, args=(3,), daemon=True).start()
                threads += 1
            except RuntimeError:
                break
        print(json.dumps({"tasks": forked + threads}))
    ''')}, "main.py", config=SandboxConfig(nproc=6, wall_s=20))
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-500:]
    assert 1 <= json.loads(r.stdout)["tasks"] <= 6 - 2  # its PID 1 and the program itself count


def test_one_process_gets_its_share_only_without_a_cgroup(monkeypatch):
    monkeypatch.setenv(sandbox_limits.MODE_ENV, "rlimit")
    program = "try:\n    bytearray({} << 20)\n    print('got')\nexcept MemoryError:\n    print('refused')"
    cfg = SandboxConfig(memory_mb=320, nproc=8)
    assert run_python({"main.py": program.format(60)}, "main.py", config=cfg).stdout == b"refused\n"
    assert run_python({"main.py": program.format(10)}, "main.py", config=cfg).stdout == b"got\n"


# ---- fail closed ---------------------------------------------------------------------------
def test_an_unknown_forced_mode_refuses_to_run(monkeypatch):
    monkeypatch.setenv(sandbox_limits.MODE_ENV, "cgroup3")
    with pytest.raises(SandboxUnavailable, match="RING_SANDBOX_MEMORY"):
        run_python({"main.py": "print(1)"}, "main.py")


def test_a_forced_cgroup_mode_this_machine_lacks_refuses_to_run(monkeypatch):
    for mode in ("cgroup2", "cgroup1"):
        try:
            sandbox_limits._probe(mode)
        except OSError:
            break
    else:
        pytest.skip("both cgroup versions work here")
    monkeypatch.setenv(sandbox_limits.MODE_ENV, mode)
    with pytest.raises(SandboxUnavailable, match=mode):
        run_python({"main.py": "print(1)"}, "main.py")


def test_a_cgroup_that_cannot_be_made_refuses_to_run(monkeypatch):
    mode = sandbox_info()["memory"]
    if mode == "rlimit":
        pytest.skip("no cgroup on this machine: the rlimit tests cover it")

    def fail(*_):
        raise PermissionError(13, "Permission denied", "cgroup")

    monkeypatch.setitem(sandbox_limits.CREATE, mode, fail)
    with pytest.raises(SandboxUnavailable, match="memory limit"):
        run_python({"main.py": "print(1)"}, "main.py")
    row = {"domain": "code", "reference": {"tests": [{"input": "", "output": "1"}]}}
    with pytest.raises(SandboxUnavailable):  # the reward does not score it 0 and go on: training stops
        verify(row, "```python\nprint(1)\n```")


def test_cgroups_are_removed_after_each_run(monkeypatch):
    mode = sandbox_info()["memory"]
    if mode == "rlimit":
        pytest.skip("no cgroup on this machine")
    made = []

    def record(*args, _real=sandbox_limits.CREATE[mode]):
        dirs = _real(*args)
        made.extend(dirs)
        return dirs

    monkeypatch.setitem(sandbox_limits.CREATE, mode, record)
    programs = ["print(1)", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(2)",
                "while True:\n    pass"]
    for p in programs:
        run_python({"main.py": p}, "main.py", config=SandboxConfig(wall_s=1.5, cpu_s=1))
    assert made and not [d for d in made if os.path.exists(d)]


def test_without_cgroups_the_fallback_is_chosen_and_holds(tmp_path):
    # a mount namespace where the cgroup file systems are hidden: auto mode must fall back to
    # the rlimit split, not run without a whole-program bound
    code = textwrap.dedent(f'''
        import json
        from verifiers.sandbox import SandboxConfig, run_python, sandbox_info
        r = run_python({{"main.py": {spread("fork_children")!r}}}, "main.py", config=SandboxConfig(**{CFG!r}))
        print(json.dumps([sandbox_info()["memory"], r.returncode, r.stdout.decode()]))
    ''')
    out = subprocess.run(["unshare", "--mount", "sh", "-c", 'mount -t tmpfs none /sys/fs/cgroup && exec "$@"', "sh",
                          sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                         env={**os.environ, "PYTHONPATH": str(PROJECT)})
    mode, rc, stdout = json.loads(out.stdout.strip().splitlines()[-1])
    assert mode == "rlimit" and rc == 0, out.stderr[-1000:]
    assert json.loads(stdout)["held"] * CHUNK <= SandboxConfig(**CFG).memory_bound_mb("rlimit")


# ---- private temp dirs ---------------------------------------------------------------------
@pytest.mark.parametrize("private", [("tmp",), ("parent",), ("grandparent",), ("grandparent", "parent", "tmp")])
def test_sandboxes_work_under_a_private_tmpdir(tmp_path, monkeypatch, private):
    levels = {"grandparent": tmp_path / "g", "parent": tmp_path / "g" / "p", "tmp": tmp_path / "g" / "p" / "t"}
    levels["tmp"].mkdir(parents=True)
    for name, d in levels.items():
        d.chmod(0o700 if name in private else 0o755)
    modes = {d: stat.S_IMODE(d.stat().st_mode) for d in levels.values()}
    monkeypatch.setattr(tempfile, "tempdir", str(levels["tmp"]))
    r = run_python({"main.py": "print(open('in.txt').read()); open('out.txt', 'w').write('back')", "in.txt": "hello"},
                   "main.py", collect=("out.txt",))
    assert (r.returncode, r.stdout, r.files) == (0, b"hello\n", {"out.txt": b"back"}), r.stderr[-500:]
    row = {"domain": "code", "reference": {"tests": [{"input": "1 2", "output": "3"}]}}
    assert verify(row, "```python\na, b = map(int, input().split())\nprint(a + b)\n```").score == 1.0
    # the host's private dirs were not opened to anyone, and the scratch dirs are gone
    assert {d: stat.S_IMODE(d.stat().st_mode) for d in levels.values()} == modes
    assert os.listdir(levels["tmp"]) == []


def test_a_private_tmpdir_from_the_environment_reaches_pool_workers(tmp_path):
    # a short path, as a scheduler's TMPDIR is: the pool's forkserver binds an AF_UNIX socket
    # under it, and a socket path has at most 107 bytes (pytest's tmp_path can exceed that)
    private = Path(tempfile.mkdtemp(prefix="ring-job-", dir="/tmp"))
    private.chmod(0o700)
    code = textwrap.dedent('''
        from verifiers import verify_batch
        row = {"domain": "code", "reference": {"tests": [{"input": "2 3", "output": "5"}]}}
        r = verify_batch([row], ["```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```"], num_workers=1)
        print(r[0].score, r[0].reason)
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=False,
                         env={**os.environ, "PYTHONPATH": str(PROJECT), "TMPDIR": str(private)})
    try:
        assert out.stdout.startswith("1.0 "), out.stdout + out.stderr[-1000:]
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(private, ignore_errors=True)
