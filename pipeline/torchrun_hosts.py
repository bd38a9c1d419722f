"""torchrun over several nodes from a hostfile, the way the DeepSpeed launcher does it.

    python -m pipeline.torchrun_hosts --hostfile H --nodes N --nproc-per-node P --port PORT \\
        -- -m stages.sft.job --job job.json

The hostfile is DeepSpeed's: one `hostname slots=K` per line (`#` comments, blank lines
skipped); the first N hosts are the nodes, node rank in file order, and the first one is the
rendezvous master (torchrun's static rendezvous: `--master-addr` / `--master-port`). On each
host one `torchrun --nnodes N --node-rank i --nproc-per-node P` starts: as a child process on
this machine when the host is this machine (localhost, a loopback address, its own name), over
`ssh host` elsewhere (in the same directory, with the launch environment: PYTHON*, NCCL_*,
TORCH_*, HF_*, MLFLOW_*, AWS_*, RING_*, ... as the DeepSpeed launcher exports it, and the
variables named in $RING_FORWARD_ENV (the job's credentials, stages.common.secrets), sent on the
ssh session's stdin as a script, never on a command line that `ps` shows; the hosts need
passwordless ssh and the same checkout path, as for DeepSpeed). When one node's torchrun fails
the others are stopped (SIGTERM, SIGKILL after STOP_GRACE_S), and this process exits with the
failing code; a stop signal is passed on to every node.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# the environment a remote node's command gets (by name prefix)
EXPORTED_ENV = ("PYTHON", "NCCL_", "TORCH_", "NVSHMEM_", "CUDA_", "HF_", "MLFLOW_", "AWS_", "OMP_",
                "TOKENIZERS_", "GLOO_", "UCX_", "RING_")
FORWARD_ENV = "RING_FORWARD_ENV"  # comma-separated names of more variables to export (pipeline.launch)


STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL, to the other nodes when one fails


class HostfileError(ValueError):
    """The hostfile cannot start the requested nodes; the message says why and where."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int | None
    line: int


def read_hostfile(path: str | Path) -> list[Host]:
    hosts: list[Host] = []
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostfileError(f"hostfile {path}: cannot be read ({e.strerror or e})") from None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        slots = None
        for item in rest:
            key, _, value = item.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise HostfileError(f"hostfile {path}:{n}: expected `hostname slots=N`, got {raw.strip()!r}")
            slots = int(value)
        if any(h.name == name for h in hosts):
            raise HostfileError(f"hostfile {path}:{n}: host {name!r} is listed twice")
        hosts.append(Host(name, slots, n))
    return hosts


def choose_nodes(hosts: list[Host], nodes: int, nproc: int, path: str | Path) -> list[Host]:
    if len(hosts) < nodes:
        raise HostfileError(f"hostfile {path} lists {len(hosts)} host(s), the stage asks for nodes={nodes}")
    chosen = hosts[:nodes]
    short = [h for h in chosen if h.slots is not None and h.slots < nproc]
    if short:
        h = short[0]
        raise HostfileError(f"hostfile {path}:{h.line}: {h.name} has slots={h.slots}, the stage starts "
                            f"{nproc} rank(s) per node")
    return chosen


def is_this_machine(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return host.startswith("127.") or socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def node_command(host: Host, rank: int, nodes: int, nproc: int, master: str, port: int,
                 program: list[str]) -> tuple[list[str], str | None]:
    """The command that starts the node's torchrun, and the script its stdin gets (remote
    nodes: `sh -s` reads the environment and the command from it, so no value is in argv)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(rank),
                "--nproc-per-node", str(nproc), "--master-addr", master, "--master-port", str(port), *program]
    if is_this_machine(host.name):
        return torchrun, None
    named = {n for n in os.environ.get(FORWARD_ENV, "").split(",") if n}
    exports = [f"export {k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
               if (k.startswith(EXPORTED_ENV) or k in named) and k.isidentifier()]
    script = "\n".join([f"cd {shlex.quote(os.getcwd())}", *exports, f"exec {shlex.join(torchrun)}", ""])
    return ["ssh", "-o", "BatchMode=yes", host.name, "sh", "-s"], script


def _start(command: list[str], script: str | None) -> subprocess.Popen:
    proc = subprocess.Popen(command, start_new_session=True, stdin=subprocess.PIPE if script else None, text=True)
    if script:
        proc.stdin.write(script)  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]
    return proc


def master_address(host: Host) -> str:
    return "127.0.0.1" if host.name == "localhost" else host.name


def run(hostfile: str, nodes: int, nproc: int, port: int, program: list[str]) -> int:
    chosen = choose_nodes(read_hostfile(hostfile), nodes, nproc, hostfile)
    master = master_address(chosen[0])
    procs = [_start(*node_command(h, i, nodes, nproc, master, port, program)) for i, h in enumerate(chosen)]

    stopped_at: list[float] = []  # when the nodes were told to stop (a failure or a signal)

    def stop(signum=signal.SIGTERM, _frame=None) -> None:
        if not stopped_at:
            stopped_at.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    failed = 0
    # poll every node each round (a short-circuiting any() would leave a failed node unseen
    # while an earlier one still runs)
    while None in [p.poll() for p in procs]:
        bad = next((p.returncode for p in procs if p.returncode not in (None, 0)), 0)
        if bad and not failed:
            failed = bad
            print(f"torchrun_hosts: a node exited with code {bad}; stopping the others", file=sys.stderr, flush=True)
            stop()
        elif stopped_at and time.monotonic() - stopped_at[0] > STOP_GRACE_S:
            # a torchrun blocked in the rendezvous (waiting for the failed node) runs no
            # signal handler until its store wait times out: kill it
            stop(signal.SIGKILL)
        time.sleep(0.2)
    return failed or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hostfile", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- then torchrun's program arguments")
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    try:
        return run(args.hostfile, args.nodes, args.nproc_per_node, args.port, program)
    except HostfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
