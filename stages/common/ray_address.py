"""The format of a Ray cluster address (`ray.address` in a recipe, `$RAY_ADDRESS`).

The recipe's address is checked where the recipe is loaded (RaySettings), so a mistyped one is
named at its `file:line` before anything is planned or launched; pipeline/ray_launch.py checks
`$RAY_ADDRESS` (which `auto` follows, and no recipe holds) the same way before it connects.
Ray's own client, given an address it cannot use, says "Name or service not known" or waits
minutes: neither names the mistake.
"""
from __future__ import annotations

import ipaddress
import re

EXPECTED = ("expected auto, host:port or ray://host:port (the head's GCS address host:6379, or the Ray "
            "Client address ray://host:10001; an IPv6 host in brackets: [::1]:6379)")
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of a `host:port` or `ray://host:port` address, an IPv6 host without its
    brackets (as a socket takes it). ValueError saying what is wrong with any other address."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        rest = address
    elif scheme.lower() in ("http", "https"):
        raise ValueError("this looks like the Ray dashboard / job-submission address (what `ray job submit` "
                         "uses, port 8265), which runs no stage: give the cluster's GCS address host:6379 "
                         "or its Ray Client address ray://host:10001")
    elif scheme != "ray":
        raise ValueError(f"unknown scheme {scheme}://; {EXPECTED}")
    if rest.startswith("["):
        host, closed, port = rest[1:].partition("]")
        if not closed or not port.startswith(":"):
            raise ValueError(f"no port after the bracketed IPv6 host; {EXPECTED}")
        port = port[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"[{host}] is not an IPv6 address; {EXPECTED}") from None
    else:
        host, colon, port = rest.rpartition(":")
        if ":" in host:
            raise ValueError(f"an IPv6 host goes in brackets ([{host}]:{port}); {EXPECTED}")
        if not colon or not host:
            raise ValueError(f"no host:port; {EXPECTED}")
        if not _HOST.fullmatch(host):
            raise ValueError(f"{host!r} is not a host name or IP address; {EXPECTED}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"the port {port!r} is not a number from 1 to 65535; {EXPECTED}")
    return host, int(port)


def check_address(address: str) -> str:
    """A recipe's `ray.address`: `auto`, or an address `split_address` takes."""
    if address != "auto":
        split_address(address)
    return address
