"""DeepSpeed's just-in-time ops are kept per Python environment (stages/common/extension_cache.py):
below torch's own default root, one directory per `sys.prefix`, and a directory the user names
is kept. (That a rank builds and loads its op there: tests/stages/common/test_distributed_shm.py.)"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from stages.common import extension_cache


@pytest.mark.parametrize("xdg", [None, "elsewhere"])
def test_the_directory_is_below_torchs_default_root(xdg, tmp_path, monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    if xdg:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / xdg))
    else:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert extension_cache.environment_extension_dir().parent == Path(get_default_build_root())


def test_each_environment_has_its_own_directory(tmp_path, monkeypatch):
    dirs = set()
    for prefix in (sys.prefix, tmp_path / "venv-a", tmp_path / "venv-b"):
        monkeypatch.setattr(sys, "prefix", str(prefix))
        dirs.add(extension_cache.environment_extension_dir())
    assert len(dirs) == 3
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv-a") + "/")  # the same environment, spelt otherwise
    assert extension_cache.environment_extension_dir() in dirs


@pytest.mark.parametrize("given", [None, "", "/opt/ops"])
def test_a_directory_the_user_names_is_kept(given, monkeypatch):
    if given is None:
        monkeypatch.delenv(extension_cache.VARIABLE, raising=False)
    else:
        monkeypatch.setenv(extension_cache.VARIABLE, given)
    extension_cache.use_environment_extension_dir()
    expected = given or str(extension_cache.environment_extension_dir())
    assert os.environ[extension_cache.VARIABLE] == expected
