"""Where DeepSpeed's just-in-time ops are built and kept: a directory per Python environment.

DeepSpeed compiles some of its ops the first time a rank needs them; on CPU, its shared-memory
all-reduce, inside `deepspeed.init_distributed` (two C++ files against torch's headers: ~120
CPU-s, a minute of a 2-core machine, while every other rank waits). torch keeps the build in
~/.cache/torch_extensions/py311_cpu/<op> by default: one directory for every environment of
that Python version. Its build file names the environment's own paths (torch's headers,
DeepSpeed's sources), so an op built by another venv is compiled again, and two environments
used in turn (a CI interpreter and a developer's venv) rebuilt it at every switch. Each
environment gets its own directory below torch's default root, named after `sys.prefix`,
unless `$TORCH_EXTENSIONS_DIR` names one.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

VARIABLE = "TORCH_EXTENSIONS_DIR"  # read by torch.utils.cpp_extension when it builds or loads an op


def environment_extension_dir() -> Path:
    """This environment's directory for built ops: below torch's default root
    (`torch.utils.cpp_extension.get_default_build_root()`, computed without importing torch)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return Path(os.path.realpath(cache)) / "torch_extensions" / f"env-{tag}"


def use_environment_extension_dir() -> None:
    """Point this process (and what it starts) at this environment's directory, unless
    `$TORCH_EXTENSIONS_DIR` is set: call it before DeepSpeed builds or loads an op."""
    if not os.environ.get(VARIABLE):
        os.environ[VARIABLE] = str(environment_extension_dir())
