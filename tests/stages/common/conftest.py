"""A process group for the tests of the stages' common pieces."""
from __future__ import annotations

import pytest


@pytest.fixture
def gloo_group(monkeypatch):
    """This process as a world of one on gloo (as a stage job without a launcher); left after."""
    import torch.distributed as dist

    from stages.common.distributed import init_distributed

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}.items():  # a world of one: its store binds any port
        monkeypatch.setenv(k, v)
    yield init_distributed()
    if dist.is_initialized():
        dist.destroy_process_group()
    # DeepSpeed keeps a clone of the world group it made for the first engine: the next test's
    # group is a new one, and an engine built then would broadcast over the destroyed clone
    # ("Group ... is not registered"), so its cache goes with the group it was cloned from
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        groups._WORLD_GROUP = None
