"""benchmarks/ray_fault.py's verdict: the facts of a fault run pass only when the stage failed fast
after the kill, its failure names the killed worker (rank and Ray worker pid, SIGKILL), and the
rerun resumed from the last published checkpoint and finished. The run itself is its --smoke (a
Ray cluster: minutes, not in the suite; tests/stages/test_ray_cluster.py has the suite's kill test)."""
from __future__ import annotations

import copy

import pytest

from benchmarks.ray_fault import problems

REASON = ("worker rank 2 (node gpu1 10.0.0.5, Ray node 98980437, pid 7461) failed first: its job exited "
          "with code 137 (killed by SIGKILL) (exit code 137)")
GOOD = {"checkpoint": {"step": 4, "seen_after_s": 40.0},
        "kill": {"at_epoch_s": 1.0, "rank": 2, "pid": 7524, "ray_worker_pid": 7461, "after_start_s": 40.1,
                 "checkpoints_published": [4]},
        "failure": {"reason": REASON, "exit_code": 137, "log": "stage.log", "kill_to_failed_s": 2.0,
                    "checkpoints_published": [4]},
        "rerun": {"status": "ran", "wall_s": 30.0, "resumed_from_step": 4, "steps": 12, "world_size": 4}}


def _with(path: str, value):
    facts = copy.deepcopy(GOOD)
    *keys, last = path.split(".")
    node = facts
    for key in keys:
        node = node[key]
    node[last] = value
    return facts


def test_a_run_that_failed_fast_named_the_worker_and_resumed_passes():
    assert problems(GOOD, max_steps=12, world_size=4) == []


@pytest.mark.parametrize("facts, says", [
    (_with("kill", None), "no rank was killed"),
    (_with("failure", None), "finished although a rank was killed"),
    (_with("failure.kill_to_failed_s", 46.0), "failed 46.0 s after the kill"),
    # another rank named, the right rank under another worker, a failure that is not the kill
    (_with("failure.reason", REASON.replace("rank 2", "rank 0")), "does not name the killed worker"),
    (_with("failure.reason", REASON.replace("pid 7461", "pid 7460")), "does not name the killed worker"),
    (_with("failure.reason", REASON.replace("killed by SIGKILL", "ValueError")), "does not name the killed worker"),
    # a fresh start, or a resume from an older checkpoint than the last one published
    (_with("rerun.resumed_from_step", None), "resumed from step None, not from the last checkpoint (4)"),
    (_with("failure.checkpoints_published", [4, 8]), "resumed from step 4, not from the last checkpoint (8)"),
    (_with("rerun.steps", 8), "did not finish 12 steps on 4 ranks"),
    (_with("rerun.status", "skipped"), "did not finish 12 steps"),
    (_with("rerun.world_size", 2), "did not finish 12 steps on 4 ranks"),
])
def test_each_fact_out_of_place_is_named(facts, says):
    found = problems(facts, max_steps=12, world_size=4)
    assert len(found) == 1 and says in found[0], found
