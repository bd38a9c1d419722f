"""A reserved port: no other process's bind(0) or outgoing connection gets it while it is held,
and the servers it is meant for (SO_REUSEADDR: torch's TCPStore, http.server) still bind it."""
from __future__ import annotations

import datetime
import errno
import shutil
import socket
import subprocess
import sys
import textwrap
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from stages.common.ports import reserved_port

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the reservation holds the port on Linux only")


def test_a_reserved_port_refuses_plain_binds_until_released_and_takes_its_server():
    with reserved_port() as port:
        plain = socket.socket()
        with pytest.raises(OSError) as refused:
            plain.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        plain.close()
        server = HTTPServer(("127.0.0.1", port), BaseHTTPRequestHandler)  # SO_REUSEADDR, as moto's
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        server.server_close()
    with socket.socket() as after:  # released: anyone may bind it now
        after.bind(("127.0.0.1", port))


def test_torchs_rendezvous_store_binds_a_reserved_port():
    from torch.distributed import TCPStore

    for libuv in (True, False):
        with reserved_port() as port:
            store = TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30), use_libuv=libuv)
            store.set("k", "v")
            assert store.get("k") == b"v"
            del store


# In a network namespace of its own with ten ephemeral ports, every bind(0) and outgoing
# connection is made until the range is exhausted: none gets the reserved port, while a port
# merely found free (bound, read, closed: the old pattern) is the next one handed out.
_EXHAUST = textwrap.dedent("""
    import socket, sys
    sys.path.insert(0, sys.argv[1])
    from stages.common.ports import reserved_port
    open("/proc/sys/net/ipv4/ip_local_port_range", "w").write("40000 40009")
    def until_refused(open_one):
        opened = []
        while True:
            s = socket.socket()
            try:
                open_one(s)
            except OSError:
                s.close()
                return opened
            opened.append(s)
    def taken():
        bound = until_refused(lambda s: s.bind(("127.0.0.1", 0)))
        ports = [s.getsockname()[1] for s in bound]
        for s in bound:  # free the range again: the connections below get it next
            s.close()
        server = socket.socket()
        server.bind(("127.0.0.1", 50000))
        server.listen(64)
        clients = until_refused(lambda c: c.connect(("127.0.0.1", 50000)))
        ports += [c.getsockname()[1] for c in clients]
        for c in clients + [server]:
            c.close()
        return ports
    with reserved_port() as port:
        assert port not in taken(), port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        found = s.getsockname()[1]
    assert found in taken(), found
    print("ok")
""")


def test_no_other_bind_or_connection_gets_a_reserved_port_even_when_ports_run_out(tmp_path):
    from tests.conftest import REPO

    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a network namespace of its own (unshare -n: root or user namespaces)")
    script = tmp_path / "exhaust.py"
    script.write_text(_EXHAUST)
    out = subprocess.run([unshare, "-n", "sh", "-c", f"ip link set lo up 2>/dev/null; {sys.executable} {script} {REPO}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
