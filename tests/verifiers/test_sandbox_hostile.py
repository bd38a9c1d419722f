"""Hostile programs, by category of attack, in the sandbox mode CI has (namespace mode).

Each probe runs through the public interface (``run_python``; ``verify`` / ``verify_files``
where the attack is on the reward), reports what it managed as JSON, and the test checks
the host's side: nothing outside the sandbox was read, written, reached, signalled or
left running.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from verifiers import verify
from verifiers.cli import verify_files
from verifiers.sandbox import HOST_ID_RANGE, SandboxConfig, _allow_list, isolation_mode, run_python, sandbox_info

pytestmark = [pytest.mark.timeout(120),
              # one worker: the hostile tests count every process under a sandbox uid
              pytest.mark.xdist_group("sandbox")]
PROJECT = Path(__file__).resolve().parents[2]
WALK = '''
def walk():
    seen = []
    for d, dirs, files in os.walk("/", followlinks=False):
        seen += [os.path.join(d, n) for n in dirs + files]
    return seen
'''


@pytest.fixture(scope="module", autouse=True)
def namespace_mode():
    assert isolation_mode() == "ns", "CI runs as root on Linux: namespace mode must work here"


def probe(program: str, stdin: str = "", **config) -> dict:
    """Run ``program`` (which ends by printing one JSON report) and return the report."""
    src = "import json, os, sys\n" + WALK + textwrap.dedent(program)
    r = run_python({"main.py": src}, "main.py", stdin=stdin, config=SandboxConfig(**{"wall_s": 20, **config}))
    assert r.returncode == 0 and not r.timed_out, r.stderr.decode(errors="replace")[-2000:]
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


def sandbox_processes() -> list[psutil.Process]:
    """Host processes running under a sandbox uid (the verifier runs as root), but for those
    another test process started (the other xdist worker's sandboxes run meanwhile)."""
    out = []
    for p in psutil.process_iter(["uids"]):
        if _sandboxed(p) and not _started_by_another_test(p):
            out.append(p)
    return out


def assert_sandbox_processes_end(within_s: float = 5.0) -> None:
    """No sandboxed process of ours is left `within_s` after the sandbox returned. The kill is
    sent before it returns, but a killed process leaves the process table only once the kernel
    tore it down and its parent (the container's init) reaped it: on a loaded 2-core machine
    that took longer than a fixed 0.3 s look (two failures in one suite run). A process that
    survives the kill still fails here."""
    deadline = time.monotonic() + within_s
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], [(p.pid, p.info) for p in left]


def _sandboxed(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        uids = p.uids()
        return HOST_ID_RANGE[0] <= uids.real < HOST_ID_RANGE[1]
    return False


def _started_by_another_test(p: psutil.Process) -> bool:
    """Whether the host-side parent of `p`'s sandbox is a Python process outside this test
    process's tree. A leftover of ours hangs under this process or, orphaned, under init."""
    with contextlib.suppress(psutil.Error):
        host_parent = next((a for a in p.parents() if not _sandboxed(a)), None)
        if host_parent is None or host_parent.pid == os.getpid():
            return False
        ours = os.getpid() in {a.pid for a in host_parent.parents()}
        return not ours and host_parent.name().startswith("python")
    return False


@pytest.fixture
def host_places(tmp_path):
    """Secrets and writable dirs in places a deny-list would not name: a fresh top-level
    dir, a world-writable dir under /tmp, the project, a data dir under /var."""
    token = uuid.uuid4().hex
    dirs = [Path(f"/ring-hostile-{token[:8]}"), tmp_path / "open", PROJECT / f".hostile-{token[:8]}",
            Path(f"/var/tmp/ring-hostile-{token[:8]}")]
    for d in dirs:
        d.mkdir(parents=True)
        d.chmod(0o777)
        (d / "secret.txt").write_text(f"expected output: {token}\n")
        (d / "secret.txt").chmod(0o666)
    yield token, dirs
    for d in dirs:
        subprocess.run(["rm", "-rf", str(d)], check=True)


def test_file_system_is_the_allow_list_only(host_places):
    token, dirs = host_places
    report = probe('''
        print(json.dumps({"paths": walk()}))
    ''')
    expose, mask = _allow_list()
    allowed = [p for p, _ in expose] + ["/work", "/tmp", "/dev/null", "/dev/zero", "/dev/full", "/dev/random",
                                        "/dev/urandom"]
    for path in report["paths"]:
        inside = any(path == a or path.startswith(a.rstrip("/") + "/") for a in allowed)
        parent = any(a.startswith(path.rstrip("/") + "/") for a in allowed)
        assert inside or parent, f"{path} is visible in the sandbox"
    assert not any(path.startswith(m + "/") for m in mask for path in report["paths"])
    assert not any(str(d) in p for d in dirs for p in report["paths"])


def test_reading_outside_the_work_dir(host_places):
    token, dirs = host_places
    secrets = [str(d / "secret.txt") for d in dirs]
    report = probe('''
        got, how = "", []
        for path in json.loads(sys.stdin.read()):
            for attempt, fn in (
                ("open", lambda p: open(p).read()),
                ("dotdot", lambda p: open("../" * 12 + p.lstrip("/")).read()),
                ("symlink", lambda p: (os.symlink(p, "s"), open("s").read())[1]),
                ("hardlink", lambda p: (os.link(p, "h"), open("h").read())[1]),
                ("rename", lambda p: (os.rename(p, "r"), open("r").read())[1]),
            ):
                for leftover in ("s", "h", "r"):
                    if os.path.lexists(leftover):
                        os.unlink(leftover)
                try:
                    got += fn(path)
                    how.append(attempt)
                except OSError:
                    pass
        print(json.dumps({"got": got, "how": how}))
    ''', stdin=json.dumps(secrets))
    assert token not in report["got"] and not report["how"]
    for s in secrets:  # still there, unchanged
        assert Path(s).read_text() == f"expected output: {token}\n"


def test_the_task_file_with_expected_outputs_is_out_of_reach(tmp_path):
    # the CLI's input sits in a data dir; a cheat looks for it to print the expected output
    token = str(uuid.uuid4().int % 10**12)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": 1, "domain": "code", "reference": {
        "tests": [{"input": "", "output": token + "\n"}], "timeout_s": 10}}) + "\n")
    cheat = textwrap.dedent('''
        import os, re
        found = set()
        for d, _, files in os.walk("/"):
            for n in files:
                try:
                    found |= set(re.findall(r"\\d{6,}", open(os.path.join(d, n), errors="ignore").read(1 << 20)))
                except OSError:
                    pass
        print(max(found, key=len) if found else "0")
    ''')
    (tmp_path / "responses.jsonl").write_text(json.dumps({"id": 1, "response": f"```python\n{cheat}\n```"}) + "\n")
    summary = verify_files(str(data), str(tmp_path / "responses.jsonl"), str(tmp_path / "out.jsonl"), num_workers=0,
                           timeout_s=30)
    assert summary["mean_score"] == 0


def test_writing_outside_the_work_dir(host_places):
    token, dirs = host_places
    before = {d: sorted(os.listdir(d)) for d in dirs}
    report = probe('''
        wrote = []
        def attempt(what, fn):
            try:
                fn()
                wrote.append(what)
            except OSError:
                pass
        for d in [p for p in walk() if os.path.isdir(p) and not os.path.islink(p)] + ["/"]:
            if d.startswith(("/work", "/tmp")):
                continue
            attempt("create " + d, lambda: open(os.path.join(d, "pwned"), "w").write("x"))
            attempt("mkdir " + d, lambda: os.mkdir(os.path.join(d, "pwned-dir")))
        for path in json.loads(sys.stdin.read()):
            attempt("overwrite " + path, lambda: open(path, "w").write("x"))
            attempt("symlink-write " + path, lambda: (os.symlink(path, "/work/l"), open("/work/l", "w").write("x")))
            attempt("chmod " + path, lambda: os.chmod(path, 0o777))
            attempt("unlink " + path, lambda: os.unlink(path))
        for f in [p for p in walk() if os.path.isfile(p) and not p.startswith(("/work", "/tmp"))][:200]:
            attempt("append " + f, lambda: open(f, "a").write("x"))
            attempt("chmod " + f, lambda: os.chmod(f, 0o777))
        print(json.dumps({"wrote": wrote}))
    ''', stdin=json.dumps([str(d / "secret.txt") for d in dirs] + [str(d) for d in dirs]))
    assert report["wrote"] == []
    for d in dirs:
        assert sorted(os.listdir(d)) == before[d]
        assert (d / "secret.txt").read_text() == f"expected output: {token}\n"


class _Listener:
    """One host endpoint per socket family/kind; records anything that reaches it."""

    def __init__(self, family, kind, address):
        self.sock = socket.socket(family, kind)
        self.sock.bind(address)
        if kind == socket.SOCK_STREAM:
            self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()
        self.hits = []
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                if self.sock.type == socket.SOCK_STREAM:
                    self.hits.append(self.sock.accept())
                else:
                    self.hits.append(self.sock.recvfrom(100))
            except OSError:
                pass

    def close(self):
        self.stop = True
        self.thread.join(timeout=2)
        self.sock.close()


def test_sockets_of_every_family_reach_nothing(tmp_path):
    tmp_path.chmod(0o777)
    abstract = f"\0ring-hostile-{uuid.uuid4().hex}"
    listeners = {
        "tcp4": _Listener(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0)),
        "udp4": _Listener(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0)),
        "tcp6": _Listener(socket.AF_INET6, socket.SOCK_STREAM, ("::1", 0)),
        "unix": _Listener(socket.AF_UNIX, socket.SOCK_STREAM, str(tmp_path / "host.sock")),
        "unix_dgram": _Listener(socket.AF_UNIX, socket.SOCK_DGRAM, str(tmp_path / "host.dgram")),
        "abstract": _Listener(socket.AF_UNIX, socket.SOCK_STREAM, abstract),
    }
    for name in ("host.sock", "host.dgram"):
        (tmp_path / name).chmod(0o777)
    targets = {k: v.address[:2] for k, v in listeners.items() if k in ("tcp4", "udp4", "tcp6")}
    targets.update(unix=str(tmp_path / "host.sock"), unix_dgram=str(tmp_path / "host.dgram"), abstract=abstract)
    try:
        report = probe('''
            import socket
            t = json.loads(sys.stdin.read())
            reached, opened = [], []
            def go(name, family, kind, addr):
                try:
                    s = socket.socket(family, kind)
                    s.settimeout(1)
                    s.connect(addr)
                    s.send(b"hi")
                    reached.append(name)
                except OSError:
                    pass
            go("tcp4", socket.AF_INET, socket.SOCK_STREAM, tuple(t["tcp4"]))
            go("udp4", socket.AF_INET, socket.SOCK_DGRAM, tuple(t["udp4"]))
            go("tcp6", socket.AF_INET6, socket.SOCK_STREAM, tuple(t["tcp6"]))
            go("unix", socket.AF_UNIX, socket.SOCK_STREAM, t["unix"])
            go("unix_dgram", socket.AF_UNIX, socket.SOCK_DGRAM, t["unix_dgram"])
            go("abstract", socket.AF_UNIX, socket.SOCK_STREAM, t["abstract"])
            for name in dir(socket):  # every address family this Python knows: nothing leaves
                if name.startswith("AF_"):
                    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW):
                        try:
                            socket.socket(getattr(socket, name), kind).close()
                            opened.append(name)
                        except OSError:
                            pass
            print(json.dumps({"reached": reached, "interfaces": [n for _, n in socket.if_nameindex()],
                              "opened": sorted(set(opened))}))
        ''', stdin=json.dumps(targets))
    finally:
        time.sleep(0.3)
        for v in listeners.values():
            v.close()
    assert report["reached"] == []
    assert all(not v.hits for v in listeners.values()), {k: v.hits for k, v in listeners.items() if v.hits}
    assert report["interfaces"] == ["lo"]  # a fresh network namespace: its own loopback, nothing else
    assert "AF_PACKET" not in report["opened"]  # raw access to devices needs privileges it lacks


def test_fork_cannot_multiply_processes_or_memory():
    cfg = {"nproc": 4, "memory_mb": 200}
    report = probe('''
        import time
        children, refused = [], 0
        for _ in range(12):
            try:
                pid = os.fork()
            except OSError:
                refused += 1
                continue
            if pid == 0:
                try:
                    block = bytearray(40 << 20)  # 40 MiB each: together within the program's limit
                    block[::4096] = b"x" * len(block[::4096])
                    time.sleep(2)
                    os._exit(0)
                except MemoryError:
                    os._exit(3)
            children.append(pid)
        held = sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in children)
        try:
            bytearray(300 << 20)
            big = True
        except MemoryError:
            big = False
        print(json.dumps({"children": len(children), "refused": refused, "held": held, "big": big}))
    ''', **cfg)
    bound = SandboxConfig(**cfg)
    assert report["children"] <= bound.nproc - 1 and report["refused"] >= 12 - (bound.nproc - 1)
    assert report["held"] * 40 <= bound.memory_bound_mb(sandbox_info()["memory"])  # the whole program's limit
    assert not report["big"]  # one process stays within memory_mb (test_sandbox_limits.py: many together)


def test_fork_bomb_is_contained_and_leaves_nothing():
    t0 = time.monotonic()
    r = run_python({"main.py": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"},
                   "main.py", config=SandboxConfig(wall_s=2))
    assert r.timed_out and time.monotonic() - t0 < 10
    assert_sandbox_processes_end()
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


@pytest.mark.parametrize("where", ["/work", "/tmp"])
def test_filling_work_and_tmp_stops_at_their_caps(where):
    report = probe(f'''
        import errno
        total, error = 0, None
        for i in range(100):
            try:
                with open("{where}/fill%d" % i, "wb") as f:
                    for _ in range(4):
                        f.write(b"x" * (1 << 20))
                        f.flush()
                        total += 1 << 20
            except OSError as e:
                error = errno.errorcode[e.errno]
                break
        print(json.dumps({{"mb": total >> 20, "error": error}}))
    ''', work_mb=8, tmp_mb=8)
    assert report["error"] == "ENOSPC" and report["mb"] <= 8


def test_signalling_host_processes():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        report = probe('''
            import signal
            targets = json.loads(sys.stdin.read())
            sent = []
            for pid in targets:
                for attempt in (lambda: os.kill(pid, signal.SIGKILL),
                                lambda: signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)):
                    try:
                        attempt()
                        sent.append(pid)
                    except OSError:
                        pass
            try:
                os.kill(-1, signal.SIGKILL)  # every process it may signal: only its own namespace's
            except OSError:
                pass
            print(json.dumps({"sent": sent}))
        ''', stdin=json.dumps([sleeper.pid, os.getpid()]))
    except json.JSONDecodeError:  # the kill(-1) took the probe itself down: still check the host
        report = {"sent": []}
    finally:
        alive = sleeper.poll() is None
        sleeper.kill()
        sleeper.wait()
    assert alive and report["sent"] == []


def test_exec_of_other_binaries():
    report = probe('''
        import subprocess
        ran = []
        for cmd in (["sh", "-c", "echo pwned"], ["/bin/sh", "-c", "echo pwned"], ["/usr/bin/env"], ["ls", "/"],
                    ["/usr/bin/curl", "http://127.0.0.1"], ["busybox", "sh"]):
            try:
                subprocess.run(cmd, capture_output=True, timeout=5)
                ran.append(cmd[0])
            except (OSError, subprocess.SubprocessError):
                pass
        def elf_program(p):
            try:
                with open(p, "rb") as f:
                    return os.access(p, os.X_OK) and f.read(4) == b"\x7fELF" and ".so" not in os.path.basename(p)
            except OSError:
                return False
        executables = [p for p in walk() if os.path.isfile(p) and elf_program(p)]
        print(json.dumps({"ran": ran, "executables": executables}))
    ''')
    assert report["ran"] == []
    assert report["executables"] == [os.path.realpath(sys.executable)]


def test_environment_and_proc_secrets(monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", token)
    report = probe('''
        seen = str(dict(os.environ))
        for p in ("/proc/self/environ", "/proc/1/environ", "/proc/%d/environ" % os.getppid(),
                  "/sys/kernel", "/etc/environment", "/proc/self/mountinfo"):
            try:
                seen += open(p, errors="replace").read()
            except OSError:
                pass
        print(json.dumps({"seen": seen, "proc": os.path.exists("/proc"), "sys": os.path.exists("/sys"),
                          "uid": os.getuid()}))
    ''')
    assert token not in report["seen"]
    assert not report["proc"] and not report["sys"]
    assert report["uid"] == 1000


def test_privileges_cannot_be_regained():
    report = probe('''
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        got = []
        for what, fn in (("setuid0", lambda: os.setuid(0)), ("setgid0", lambda: os.setgid(0)),
                         ("chroot", lambda: os.chroot("/tmp")),
                         ("settime", lambda: __import__("time").clock_settime(0, 0.0))):
            try:
                fn()
                got.append(what)
            except OSError:
                pass
        if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None) == 0:
            got.append("mount")
        if libc.umount2(b"/work", 2) == 0:
            got.append("umount")
        if libc.mount(None, b"/", None, 32 | 4096, None) == 0:  # remount the root read-write
            got.append("remount")
        print(json.dumps({"got": got}))
    ''')
    assert report["got"] == []


@pytest.mark.parametrize("program", [
    "while True:\n    pass",
    "import time\ntime.sleep(600)",
    "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n"
    "    os._exit(0)\ntime.sleep(600)",
])
def test_time_limits_end_everything(program):
    t0 = time.monotonic()
    r = run_python({"main.py": program}, "main.py", config=SandboxConfig(wall_s=1.5, cpu_s=1))
    assert r.timed_out or r.returncode != 0
    assert time.monotonic() - t0 < 8
    assert_sandbox_processes_end()


def test_detached_children_die_with_the_program():
    r = run_python({"main.py": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
                               "print('done')"}, "main.py", config=SandboxConfig(wall_s=5))
    assert r.stdout == b"done\n" and not r.timed_out
    assert_sandbox_processes_end()


def test_output_flood_is_capped():
    r = run_python({"main.py": "while True:\n    print('x' * 10000)"}, "main.py",
                   config=SandboxConfig(wall_s=5, max_output_bytes=1 << 16))
    assert r.output_capped and len(r.stdout) <= 1 << 16


def test_collected_files_cannot_be_links_or_fifos():
    r = run_python({"main.py": "import os\nos.symlink('/work/main.py', 'a')\nos.mkfifo('b')\n"
                               "open('c', 'w').write('ok')"}, "main.py", collect=("a", "b", "c"))
    assert r.returncode == 0 and r.files == {"c": b"ok"}


def test_code_verifier_scores_hostile_answers_zero(host_places):
    # the same attacks through the reward: the program must print the hidden expected output
    token, dirs = host_places
    row = {"domain": "code", "reference": {"tests": [{"input": "", "output": token + "\n"}], "timeout_s": 5}}
    cheat = "\n".join([f"for p in {[str(d / 'secret.txt') for d in dirs]!r}:",
                       "    try:", "        print(open(p).read().split()[-1]); break",
                       "    except OSError: pass", "else:", "    print('nothing')"])
    r = verify(row, f"```python\n{cheat}\n```", timeout_s=30)
    assert r.score == 0 and "wrong output" in r.reason


def test_unprivileged_user_gets_the_same_sandbox():
    # as a user who is not root of the initial namespace (here: root of a nested one), the
    # sandbox maps to that user's own uid and still builds the same root
    code = ("import json; from verifiers.sandbox import run_python, isolation_mode\n"
            "r = run_python({'main.py': 'import os; print(os.getuid(), sorted(os.listdir(\"/\")))'}, 'main.py')\n"
            "print(json.dumps([isolation_mode(), r.stdout.decode(), r.returncode]))")
    out = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(PROJECT)})
    mode, stdout, rc = json.loads(out.stdout.strip().splitlines()[-1])
    assert (mode, rc) == ("ns", 0)
    assert stdout.startswith("1000 ") and "'work'" in stdout and "'home'" not in stdout


NO_USERNS = ["unshare", "--user", "--map-root-user", "sh", "-c",
             'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh"]


def _without_user_namespaces(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([*NO_USERNS, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(PROJECT), **env})


def test_without_namespaces_code_is_refused_unless_unsafe_is_opted_in():
    code = textwrap.dedent('''
        from verifiers import verify, verify_batch
        from verifiers.sandbox import SandboxUnavailable
        row = {"domain": "code", "reference": {"tests": [{"input": "1 2", "output": "3"}]}}
        ans = "```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```"
        for call in (lambda: verify(row, ans), lambda: verify_batch([row], [ans], num_workers=1)):
            try:
                call()
                print("RAN")
            except SandboxUnavailable as e:
                print("REFUSED", e)
    ''')
    out = _without_user_namespaces(code)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("REFUSED") for ln in lines), out.stdout + out.stderr
    assert "RING_SANDBOX_UNSAFE_NO_ISOLATION=1" in lines[0]
    ok = _without_user_namespaces(
        "from verifiers import verify\nfrom verifiers.sandbox import isolation_mode\n"
        "r = verify({'domain': 'code', 'reference': {'tests': [{'input': '1 2', 'output': '3'}]}},"
        " '```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```')\n"
        "print(isolation_mode(), r.score)", RING_SANDBOX_UNSAFE_NO_ISOLATION="1")
    assert ok.stdout.split() == ["unsafe", "1.0"], ok.stdout + ok.stderr


def test_unsafe_mode_guards_against_accidents(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep")
    code = ("import json; from verifiers.sandbox import run_python\n"
            f"p = {str(target)!r}\n"
            "prog = 'import os, shutil\\nfor f in (lambda: os.remove(p), lambda: open(p, \"w\"), lambda: shutil.rmtree(os.path.dirname(p))):\\n"
            "    try:\\n        f()\\n    except PermissionError:\\n        print(\"refused\")\\n'\n"
            "r = run_python({'main.py': 'p = %r\\n' % p + prog}, 'main.py')\n"
            "print(json.dumps([r.mode, r.stdout.decode()]))")
    out = _without_user_namespaces(code, RING_SANDBOX_UNSAFE_NO_ISOLATION="1")
    mode, stdout = json.loads(out.stdout.strip().splitlines()[-1])
    assert mode == "unsafe" and stdout.split() == ["refused"] * 3
    assert target.read_text() == "keep"


def test_temp_dir_removed(monkeypatch):
    made = []  # this run's own dir: the other xdist worker's sandboxes have theirs in /tmp meanwhile

    def mkdtemp(*args, _real=tempfile.mkdtemp, **kwargs):
        made.append(_real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    r = run_python({"main.py": "print('hi')"}, "main.py")
    assert r.returncode == 0
    assert made and not [d for d in made if Path(d).exists()]

