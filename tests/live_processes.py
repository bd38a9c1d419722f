"""The processes below a test's own that still run: the stage tests check that a failed or
stopped job left none. A child that has exited but was not reaped yet (a zombie: one was left in
an xdist worker by a test that failed before it) or one that exits while it is looked at is not
running, and reading its command line must not fail the check."""
from __future__ import annotations

import psutil


def command_line(process: psutil.Process) -> list[str]:
    """Its argv; [] once it has exited (a zombie's is no longer readable)."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def running_below_us(needle: str) -> list[psutil.Process]:
    """The running (not zombie) descendants of this process whose command line contains `needle`."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if needle in " ".join(command_line(process)) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found
