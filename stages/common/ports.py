"""TCP ports for servers that bind them later: a rendezvous (torch.distributed's store, bound by
a launcher or by rank 0 of the job we start) or a local server (the embedded Prefect API).

Binding port 0, reading the number and closing the socket ("a free port") leaves a window of
seconds before the server binds it, in which another process's bind(0) or outgoing connection
may get the same port: the job then dies on EADDRINUSE (two pytest workers' stage launches did).
A reservation closes that window: it keeps the port bound, with SO_REUSEADDR and never
listening, for as long as it is held. Linux then hands the port to no other bind(0) and no
outgoing connection, while a server that binds it with SO_REUSEADDR still binds and listens
on it; torch's TCPStore (libuv and classic), asyncio / uvicorn, http.server (moto) and gRPC all
set it (tests/stages/common/test_ports.py checks the kernel's side). Hold the reservation
until the server listens; simplest, until it has stopped.

Elsewhere than Linux (BSD's SO_REUSEADDR refuses a second bind of the same wildcard address)
the port is released before it is handed out, the plain free-port behaviour.
"""
from __future__ import annotations

import contextlib
import socket
import sys
from typing import Iterator


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port no other process gets by chance while the block runs; the server meant for it
    binds it (with SO_REUSEADDR) inside the block."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", 0))  # every address: a bind(0) on any interface skips it
        port = holder.getsockname()[1]
        if sys.platform != "linux":
            holder.close()
        yield port
