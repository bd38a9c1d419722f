"""The policy under DeepSpeed (stages/rl/policy.py): the DeepSpeed backend updates the policy
exactly as a plain torch optimizer does, under every ZeRO stage."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_deepspeed_update_equals_plain_torch_per_zero_stage():
    """Gradient accumulation over a varying number of micro-batches (manual boundaries)
    must give the same update under every ZeRO stage as a plain optimizer."""
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("ds_equivalence.py")), "0", "2", "3"],
                          capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [r["stage"] for r in rows] == [0, 2, 3]
    for r in rows:
        assert r["moved"] > 1e-3  # the reference update is not trivially zero
        assert r["max_param_diff"] < 1e-4, r
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-4)
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-4, abs=1e-7)


def test_zero3_ranks_with_uneven_micro_batches_call_the_head_alike():
    """Under ZeRO-3 every head call gathers its weight (a collective): ranks whose micro
    batches hold different numbers of response tokens must still call it equally often, or
    they hang (seen on 2 GPUs). Two real ranks, one long response among short ones, a head
    big enough to be partitioned: both finish, with the same reduced stats."""
    from stages.common.ports import reserved_port

    repo = Path(__file__).resolve().parents[3]
    outs = []
    with reserved_port() as port:  # until rank 0's store has bound it
        env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        script = str(Path(__file__).with_name("ds_zero3_ranks.py"))
        procs = [subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=repo, start_new_session=True)
                 for r in range(2)]
        try:
            for p in procs:
                out, err = p.communicate(timeout=240)
                assert p.returncode == 0, out[-2000:] + err[-3000:]
                outs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
    rows = [json.loads(x) for out in outs for x in out.splitlines() if x.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"]) and rows[0]["grad_norm"] == pytest.approx(rows[1]["grad_norm"])
    assert rows[0]["grad_norm"] > 0
