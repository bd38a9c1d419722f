"""Runs between the verifier and the candidate program: ``python -I -S this.py <json>``.

Stdlib only, no ``verifiers`` import (it runs with ``-S`` and must start fast).

Namespace mode (``sandbox.py`` says what it guarantees), three processes:

- this process (C) joins the program's cgroups (if any), leaves the caller's user, mount, PID, network, IPC and UTS namespaces
  with one ``unshare``, tells the caller (who writes its uid/gid maps from outside) and
  waits for the maps, then forks G and exits with G's status;
- G is PID 1 of the new PID namespace. It builds the sandbox's root from nothing: an
  empty tmpfs holding read-only bind mounts of the allow-listed host paths (the
  interpreter, its standard library, the shared libraries they load, a few device nodes,
  what the verifier declares), a size-capped tmpfs ``/tmp`` and a size-capped tmpfs work
  dir ``/work`` into which it copies the input files; then ``pivot_root`` into it and
  detaches the host's tree. It forks X, waits for it (reaping orphans as PID 1 must),
  kills whatever X left running, copies the files to collect back to the host and exits
  with X's status. When G exits the kernel kills every process left in the namespace;
- X drops to the unprivileged sandbox uid (which also drops every capability at exec),
  applies the rlimits, sets no_new_privs, installs a seccomp filter refusing memfd_create
  and shmget and execs the program in ``/work``.

Unsafe mode (no namespaces; the user opted in): rlimits, then the program runs in the
host's work dir behind an audit hook that only guards against accidents (see sandbox.py).
"""
import ctypes
import json
import os
import platform
import resource
import signal
import stat
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = (
    32, 1024, 2048, 4096, 16384, 1 << 18, 1 << 21)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# statvfs flag -> mount flag: a read-only remount must repeat the flags the kernel locked
# when the mount entered this (less privileged) namespace, or it fails with EPERM
LOCKED_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                (os.ST_RELATIME, MS_RELATIME))
SETUP_FAILED = 125  # exit status when the sandbox could not be built (stderr says why)
# seccomp: memfd_create and shmget are refused. Their pages need be in no address space
# (RLIMIT_AS does not see them: a SysV segment stays after shmdt) and in no size-capped tmpfs:
# without a memory cgroup they would escape the program's limit.
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, X32_SYSCALL_BIT = 0x7FFF0000, 0x00050000, 0x40000000
# AUDIT_ARCH_*, then the numbers of memfd_create and shmget
SECCOMP_ARCH = {"x86_64": (0xC000003E, (319, 29)), "aarch64": (0xC00000B7, (279, 194))}

UNSAFE_BOOT = r"""
import sys, os
_readable = tuple(%(readable)r)
_workdir = %(workdir)r
_blocked = {"os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym",
            "ctypes.cdata", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system",
            "subprocess.Popen", "os.putenv", "pty.spawn", "os.chmod", "os.chown", "os.symlink",
            "os.link", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.truncate",
            "shutil.rmtree", "os.chflags", "os.utime", "os.setxattr", "os.removexattr"}
_path_events = {"os.chmod", "os.chown", "os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.utime"}
def _inside(p, roots):
    return (os.path.realpath(os.fsdecode(p)) + "/").startswith(roots)
def _hook(event, args):
    if event.startswith("socket.") or (event == "import" and args[0] in ("_posixsubprocess", "_ctypes")):
        raise PermissionError("sandbox (unsafe mode): %%s is not allowed" %% event)
    if event in _path_events and args and isinstance(args[0], (str, bytes)) and _inside(args[0], (_workdir,)):
        return
    if event in ("os.rename",) and all(isinstance(a, (str, bytes)) and _inside(a, (_workdir,)) for a in args[:2]):
        return
    if event in _blocked:
        raise PermissionError("sandbox (unsafe mode): %%s is not allowed" %% event)
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        mode, flags = (args[1] if len(args) > 1 else None) or "", (args[2] if len(args) > 2 else 0) or 0
        writing = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        if not _inside(args[0], (_workdir,) if writing else (_workdir,) + _readable):
            raise PermissionError("sandbox (unsafe mode): opening %%s is not allowed" %% os.fsdecode(args[0]))
sys.addaudithook(_hook)
del _hook
import runpy
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _mount(src, target, fstype, flags, data=None):
    def b(x):
        return None if x is None else os.fsencode(x)

    _check(libc.mount(b(src), b(target), b(fstype), flags, b(data)), "mount %s on %s" % (src or fstype, target))


def _bind_readonly(src_fd, target, is_dir, device=False):
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o444))
    _mount("/proc/self/fd/%d" % src_fd, target, None, MS_BIND | MS_REC)
    os.close(src_fd)
    locked = os.statvfs(target).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if device else MS_NODEV)
    for st_flag, ms_flag in LOCKED_FLAGS:
        if locked & st_flag:
            flags |= ms_flag
    _mount(None, target, None, flags)


def _build_root(cfg):
    """Mount the allow-listed root at cfg["newroot"], copy the inputs in, pivot into it.
    Returns an fd of the host work dir (for copying collected files back)."""
    # opened while we still have our host uid: the paths may lie under dirs (/root) that
    # the sandbox's uid, which creates the mount points below, cannot traverse
    sources = [(os.open(p, os.O_PATH | os.O_CLOEXEC), p, is_dir) for p, is_dir in cfg["expose"]]
    devices = [(os.open(p, os.O_PATH | os.O_CLOEXEC), p) for p in cfg["devices"]]
    # the same for the host work dir, named relative to our cwd (the run's scratch dir), like
    # the new root below: the dirs above it may be private to the verifier (a 0700 TMPDIR)
    host_work = os.open(cfg["host_work"], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    # become the sandbox's (mapped) uid: files made in the new mounts need an owner that
    # exists in this namespace. Our host uid was not ns-root, so the capabilities stay
    # until the program's exec drops them.
    uid, gid = cfg["sandbox_id"], cfg["sandbox_id"]
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    new = cfg["newroot"]  # relative to our cwd: see host_work
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for fd, path, is_dir in sources:
        _bind_readonly(fd, new + path, is_dir)
    for path in cfg["mask"]:  # e.g. the interpreter's site-packages inside its stdlib
        _mount("tmpfs", new + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    for fd, dev in devices:
        _bind_readonly(fd, new + dev, is_dir=False, device=True)
    os.makedirs(new + "/tmp")
    _mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=1777" % cfg["tmp_mb"])
    os.makedirs(new + "/work")
    _mount("tmpfs", new + "/work", "tmpfs", MS_NOSUID | MS_NODEV,
           "size=%dm,mode=0700,uid=%d,gid=%d" % (cfg["work_mb"], uid, gid))
    for name in cfg["inputs"]:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=host_work)
        dst = os.open(new + "/work/" + name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
        try:
            while True:
                chunk = os.read(src, 1 << 20)
                if not chunk:
                    break
                os.write(dst, chunk)
        finally:
            os.close(src)
            os.close(dst)
    _mount(None, new, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(new)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError("pivot_root: no syscall number known for %s" % platform.machine())
    _check(libc.syscall(number, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the host's root")  # the old root, stacked on "."
    os.chdir("/")
    return host_work


def _collect(host_work, names, cap):
    """Copy regular files the program left in /work back to the host work dir. The program
    may have put symlinks or FIFOs there: open without following and without blocking."""
    for name in names:
        try:
            src = os.open("/work/" + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                continue
            data = os.read(src, cap)
        finally:
            os.close(src)
        dst = os.open(name, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=host_work)
        try:
            os.write(dst, data)
        finally:
            os.close(dst)


def _exit_status(status):
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _deny_unbounded_memory():
    """A seccomp filter (after no_new_privs; inherited by every child, kept across exec):
    memfd_create, shmget and the x32 syscalls fail with EPERM, everything else is allowed."""
    arch, denied = SECCOMP_ARCH.get(platform.machine(), (None, ()))
    if arch is None:
        raise OSError("seccomp: no syscall numbers known for %s" % platform.machine())
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, ...JGE, BPF_RET|BPF_K
    n = len(denied)  # layout: 0 ld arch, 1 jeq, 2 ld nr, 3 jge, 4.. one jeq each, 4+n deny, 5+n allow
    prog = [(ld, 0, 0, 4), (jeq, 0, 3 + n, arch),  # another ABI: allow (none but x32 shares this arch)
            (ld, 0, 0, 0), (jge, n, 0, X32_SYSCALL_BIT)]
    prog += [(jeq, n - 1 - i, 1 if i == n - 1 else 0, nr) for i, nr in enumerate(denied)]
    prog += [(ret, 0, 0, SECCOMP_RET_ERRNO | 1), (ret, 0, 0, SECCOMP_RET_ALLOW)]  # EPERM
    filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), filters)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def _exec_program(cfg, argv):
    """In the child that becomes the program: limits, identity, exec. Never returns."""
    try:
        for name, (soft, hard) in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if cfg["mode"] == "ns":
            ident = cfg["sandbox_id"]
            os.setresgid(ident, ident, ident)
            os.setresuid(ident, ident, ident)
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _deny_unbounded_memory()
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")  # after setuid, which clears it
        os.chdir(cfg["workdir"])
        os.closerange(3, 1 << 16)
        os.execve(argv[0], argv, cfg["env"])
    except BaseException as e:  # noqa: BLE001 - report any setup failure, never run the program half-set-up
        os.write(2, ("sandbox setup failed: %s\n" % e).encode())
    os._exit(SETUP_FAILED)


def _pid1(cfg):
    """G: PID 1 of the sandbox's PID namespace. Never returns."""
    try:
        _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        host_work = _build_root(cfg)
    except BaseException as e:  # noqa: BLE001
        os.write(2, ("sandbox setup failed: %s\n" % e).encode())
        os._exit(SETUP_FAILED)
    program = os.fork()
    if program == 0:
        _exec_program(cfg, cfg["argv"])
    while True:  # PID 1 reaps every orphan of the namespace until the program itself ends
        pid, status = os.wait()
        if pid == program:
            break
    try:
        os.kill(-1, signal.SIGKILL)  # whatever the program left behind, before reading its files
    except ProcessLookupError:
        pass
    _collect(host_work, cfg["collect"], cfg["collect_cap"])
    os._exit(_exit_status(status))


def _enter_namespaces(cfg):
    """C: unshare, let the caller write the id maps, fork G and mirror its exit."""
    ready_w, maps_r = cfg["sync_fds"]
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    try:
        _check(libc.unshare(flags), "unshare")
    except OSError as e:
        os.write(2, ("sandbox setup failed: %s\n" % e).encode())
        os._exit(SETUP_FAILED)
    os.write(ready_w, b"u")
    os.close(ready_w)
    if os.read(maps_r, 1) != b"m":  # the caller could not write the maps: it reports why
        os._exit(SETUP_FAILED)
    os.close(maps_r)
    child = os.fork()
    if child == 0:
        _pid1(cfg)
    # the caller stops a sandbox with SIGTERM: kill its PID 1 (the kernel then kills the
    # rest of the namespace) and reap it, so that no zombie is left to the host's init
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    _, status = os.waitpid(child, 0)
    os._exit(_exit_status(status))


def _join_cgroups(paths):
    """First thing, while we are the only process of the program: join its cgroups, so that
    everything started from here on is counted against its one limit (sandbox_limits.py)."""
    try:
        for path in paths:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
    except OSError as e:
        os.write(2, ("sandbox setup failed: cannot join the program's cgroup: %s\n" % e).encode())
        os._exit(SETUP_FAILED)


def main():
    cfg = json.loads(sys.argv[1])
    _join_cgroups(cfg["cgroup_procs"])
    if cfg["mode"] == "ns":
        _enter_namespaces(cfg)
    boot = UNSAFE_BOOT % {"readable": [p.rstrip("/") + "/" for p, _ in cfg["expose"]],
                          "workdir": cfg["workdir"].rstrip("/") + "/"}
    argv = cfg["argv"]
    _exec_program(cfg, [argv[0], "-E", "-s", "-B", "-c", boot] + [a for a in argv[1:] if not a.startswith("-")])


if __name__ == "__main__":
    main()
