"""DeepSpeed's CPU ranks (started by its launcher) keep a 66 MB all-reduce workspace each in
/dev/shm and never unlink it; `init_distributed` unlinks the names once every rank has mapped
them, so a run leaves no RAM behind, and the shared-memory all-reduce still works. The kernel is
built (once) and loaded in this Python environment's own extension directory
(stages/common/extension_cache.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")


def test_cpu_ranks_leave_no_shared_memory_behind():
    from stages.common.extension_cache import VARIABLE, environment_extension_dir
    from stages.common.ports import reserved_port

    repo = Path(__file__).resolve().parents[3]
    with reserved_port() as reserved:  # until rank 0's store has bound it
        port = str(reserved)
        inherited = {k: v for k, v in os.environ.items() if k != VARIABLE}  # the rank picks its own directory
        env = {**inherited, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        script = str(Path(__file__).with_name("shm_ranks.py"))
        procs = [subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
        rows = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, out[-2000:] + err[-3000:]
            rows += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        # the ranks did use DeepSpeed's shared-memory backend, built in this environment's directory
        assert Path(r["shm_op"]).is_relative_to(environment_extension_dir()), r["shm_op"]
        assert r["sum"] == [3.0] * 8  # 1 + 2, through the unlinked but still mapped workspaces
        assert r["named"] == []       # unlinked while the ranks were still running
    assert not [p for p in os.listdir("/dev/shm") if f"_{port}_" in p]
