"""Hostile programs: each is contained (host unchanged, nothing left running) and scores 0."""
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from verifiers import verify
from verifiers.sandbox import SandboxConfig, _descendants, isolation_mode, run_python

pytestmark = pytest.mark.timeout(120)
PROJECT = Path(__file__).resolve().parents[2]


def code_row(tests, **ref):
    return {"domain": "code", "prompt": "", "reference": {"tests": tests, "timeout_s": 1, **ref}}


ADD_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 5\n", "output": "15\n"}]


def run_hostile(program, tests=ADD_TESTS, **ref):
    before = set(_descendants(os.getpid()))
    t0 = time.monotonic()
    r = verify(code_row(tests, **ref), f"<think>hm</think>\n```python\n{program}\n```", timeout_s=30)
    time.sleep(0.2)
    left = set(_descendants(os.getpid())) - before
    assert not left, f"processes left behind: {left}"
    assert time.monotonic() - t0 < 20
    return r


@pytest.fixture(params=["ns", "fallback"])
def mode(request, monkeypatch):
    if request.param == "ns" and isolation_mode() != "ns":
        pytest.skip("no usable unshare here")
    monkeypatch.setattr("verifiers.code_exec.run_python",
                        lambda *a, **k: run_python(*a, **{**k, "mode": request.param}))
    return request.param


def test_correct_program_scores_one_in_both_modes(mode):
    r = run_hostile("a, b = map(int, input().split())\nprint(a + b)")
    assert r.score == 1, r.reason


def test_infinite_loop(mode):
    r = run_hostile("while True:\n    pass")
    assert r.score == 0 and "timeout" in r.reason


def test_fork_bomb(mode):
    r = run_hostile("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert r.score == 0


def test_memory_bomb(mode):
    r = run_hostile("x = []\nwhile True:\n    x.append(bytearray(50 * 1024 * 1024))")
    assert r.score == 0


def test_stdout_flood(mode):
    r = run_hostile("while True:\n    print('x' * 10000)")
    assert r.score == 0 and ("output limit" in r.reason or "timeout" in r.reason)


def test_writing_outside_its_directory(mode, tmp_path):
    target = PROJECT / "verifiers" / "PWNED.txt"
    other = Path("/tmp") / f"ring-pwned-{os.getpid()}"
    prog = (f"for p in [{str(target)!r}, {str(other)!r}, '/etc/ring-pwned']:\n"
            "    try:\n        open(p, 'w').write('x')\n    except Exception:\n        pass\n"
            "a, b = map(int, input().split())\nprint(a + b + 1)")
    r = run_hostile(prog)
    assert r.score == 0
    assert not target.exists() and not other.exists() and not Path("/etc/ring-pwned").exists()


def test_reading_project_files_and_secrets(mode, monkeypatch):
    # the tests live in a file next to the project; a cheat reads them and prints the answer
    secret_file = PROJECT / "verifiers" / ".sandbox_test_secret"
    secret_file.write_text("3\n15\n")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    try:
        prog = ("import os, sys\nsrc = ''\n"
                f"for p in [{str(secret_file)!r}, '/proc/1/environ', '/proc/%d/environ' % os.getppid()]:\n"
                "    try:\n        src += open(p, errors='replace').read()\n    except Exception:\n        pass\n"
                "src += str(dict(os.environ))\n"
                "lines = [l for l in src.splitlines() if l.strip().isdigit()]\n"
                "print('L' + 'EAKED' if 'hunter2' in src else lines.pop(0))\n")
        r = run_hostile(prog)
        assert r.score == 0
        assert "LEAKED" not in str(r.details)
        # nothing was readable: neither the file nor any environ had a line to print
        assert "IndexError: pop fro" in str(r.details)
    finally:
        secret_file.unlink()


def test_network_connection(mode):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(3)
    port = srv.getsockname()[1]
    hits = []
    th = threading.Thread(target=lambda: hits.append(srv.accept()) if True else None, daemon=True)

    def accept():
        try:
            hits.append(srv.accept())
        except OSError:
            pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    prog = ("import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'hi')\nprint(3)")
    r = run_hostile(prog, tests=[{"input": "", "output": "3\n"}])
    th.join(timeout=4)
    srv.close()
    assert r.score == 0 and not hits


def test_killing_its_parent(mode):
    prog = ("import os, signal\n"
            "for pid in (os.getppid(), 0, -1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL) if pid > 0 else os.killpg(os.getpgid(0), signal.SIGKILL)\n"
            "    except Exception:\n        pass\n"
            "print(3)")
    r = run_hostile(prog, tests=[{"input": "", "output": "4\n"}])
    assert r.score == 0  # and we are still alive to assert it


def test_detached_child_is_killed():
    if isolation_mode() != "ns":
        pytest.skip("namespace mode only")
    marker = f"ring-detached-{os.getpid()}"
    prog = ("import os, time, sys\n"
            "if os.fork() == 0:\n    os.setsid()\n"
            f"    sys.argv[0] = {marker!r}\n    time.sleep(60)\n"
            "print('done')")
    r = run_python({"main.py": prog}, "main.py", config=SandboxConfig(wall_s=3))
    assert r.stdout == b"done\n"
    time.sleep(0.3)
    alive = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if "time.sleep(60)" in Path(f"/proc/{d}/cmdline").read_text():
                    alive.append(d)
            except OSError:
                pass
    assert not alive


def test_temp_dir_removed():
    r = run_python({"main.py": "import os; print(os.getcwd())"}, "main.py")
    assert r.returncode == 0
    assert not os.path.exists(r.stdout.decode().strip())
