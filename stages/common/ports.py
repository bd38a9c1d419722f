"""A free TCP port on this host: a rendezvous (torch.distributed's, a launcher's) or a local
server (the embedded Prefect API) binds it next."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
