"""Runs inside the sandbox before the candidate program: ``python -S this.py <json>``.

Stdlib only, no ``verifiers`` import (it runs with ``-S`` and must start fast). In
namespace mode it is PID 1 of fresh PID/mount/network namespaces (``unshare`` made them):
it hides host directories under empty tmpfs mounts, re-exposes the Python installation
read-only, drops to an unprivileged uid, applies rlimits and execs the program. In
fallback mode (no namespaces) it only applies rlimits and execs the program behind an
audit hook that refuses sockets, signals, process creation, ctypes, writes outside the
work directory and reads of hidden paths.
"""
import ctypes
import json
import os
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38

FALLBACK_BOOT = r"""
import sys, os
_hidden = tuple(%(hidden)r)
_allowed = tuple(%(allowed)r)
_workdir = %(workdir)r
_blocked_events = {"os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
                   "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system",
                   "subprocess.Popen", "os.putenv", "pty.spawn"}
def _hook(event, args):
    if event.startswith("socket.") or event in _blocked_events:
        raise PermissionError("sandbox (fallback mode): %%s is not allowed" %% event)
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        p = os.path.abspath(os.fsdecode(args[0])) + "/"
        if p.startswith(_workdir):
            return
        mode, flags = (args[1] if len(args) > 1 else None) or "", (args[2] if len(args) > 2 else 0) or 0
        if any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            raise PermissionError("sandbox (fallback mode): writing %%s is not allowed" %% p)
        if p.startswith(_allowed):
            return
        if p.startswith(_hidden) or (p.startswith("/proc/") and not p.startswith("/proc/self/")):
            raise PermissionError("sandbox (fallback mode): reading %%s is not allowed" %% p)
sys.addaudithook(_hook)
del _hook
import runpy
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _mount(libc, src, target, fstype, flags, data):
    def b(x):
        return None if x is None else os.fsencode(x)

    if libc.mount(b(src), b(target), b(fstype), flags, b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s on %s failed: %s" % (fstype or src, target, os.strerror(err)))


def _setup_namespace(cfg):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    # open what must stay reachable before covering it
    expose_fds = [(p, os.open(p, os.O_RDONLY | os.O_DIRECTORY)) for p in cfg["expose"]]
    work_fd = os.open(cfg["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    for path in sorted(cfg["hide"], key=len):
        if os.path.isdir(path) and not os.path.islink(path):
            mode = "1777" if path in ("/tmp", "/var/tmp", "/dev/shm") else "755"
            _mount(libc, "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=" + mode)
    for path, fd in expose_fds:
        if not os.path.isdir(path):  # covered by a tmpfs: recreate the mount point
            os.makedirs(path, exist_ok=True)
            _mount(libc, "/proc/self/fd/%d" % fd, path, None, MS_BIND | MS_REC, None)
            _mount(libc, None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, None)
        os.close(fd)
    if not os.path.isdir(cfg["workdir"]):
        os.makedirs(cfg["workdir"], exist_ok=True)
        _mount(libc, "/proc/self/fd/%d" % work_fd, cfg["workdir"], None, MS_BIND, None)
    os.close(work_fd)


def main():
    cfg = json.loads(sys.argv[1])
    if cfg["mode"] == "ns":
        _setup_namespace(cfg)
    for name, value in cfg["rlimits"].items():
        soft, hard = value
        resource.setrlimit(getattr(resource, name), (soft, hard))
    uid = cfg.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir(cfg["workdir"])
    argv = cfg["argv"]
    if cfg["mode"] != "ns":
        boot = FALLBACK_BOOT % {"hidden": [p.rstrip("/") + "/" for p in cfg["hide"]],
                                "allowed": [p.rstrip("/") + "/" for p in cfg["expose"]],
                                "workdir": cfg["workdir"].rstrip("/") + "/"}
        argv = [argv[0], "-E", "-s", "-B", "-c", boot] + [a for a in argv[1:] if not a.startswith("-")]
    os.execve(argv[0], argv, cfg["env"])


if __name__ == "__main__":
    main()
