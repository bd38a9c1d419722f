"""torchrun over several nodes from a hostfile (pipeline/torchrun_hosts.py, launch.py): a
2-"node" run on localhost (two hostfile entries that are this machine, one torchrun each)
forms one process group; one failing node stops the other; hostfiles that cannot start the
nodes are refused, naming the line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.launch import launch_command, launch_job
from pipeline.torchrun_hosts import HostfileError, choose_nodes, read_hostfile
from stages.common.contract import Resources, StageFailed, launch_problem

pytestmark = pytest.mark.slow


def _launch(tmp_path: Path, resources: Resources, *extra: str):
    job = tmp_path / "job.json"
    with launch_command("tests.pipeline.world_probe", job, resources, "torchrun", True) as cmd:
        return job, launch_job(cmd + list(extra), "probe", tmp_path / "probe.log", resources)


def test_two_nodes_on_localhost_form_one_process_group(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two 'nodes' that are this machine\nlocalhost slots=2\n127.0.0.1 slots=2\n")
    resources = Resources(nodes=2, cpu_ranks=2, hostfile=str(hostfile))
    job, _ = _launch(tmp_path, resources)
    seen = sorted((json.loads(p.read_text()) for p in tmp_path.glob("job.json.rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in seen] == [0, 1, 2, 3] and {r["world"] for r in seen} == {4}
    assert [(r["node"], r["local_rank"]) for r in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["sum"] for r in seen} == {1 + 2 + 3 + 4}


def test_a_failing_node_stops_the_run(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost\n127.0.0.1\n")
    with pytest.raises(StageFailed, match="exited with code 1") as e:
        _launch(tmp_path, Resources(nodes=2, cpu_ranks=1, hostfile=str(hostfile)), "--fail-node", "1")
    assert "node 1 fails on purpose" in str(e.value) or "node 1 fails" in (tmp_path / "probe.log").read_text()
    assert not list(tmp_path.glob("job.json.rank*.json"))


def test_hostfiles_that_cannot_start_the_nodes_are_refused(tmp_path):
    f = tmp_path / "hostfile"
    f.write_text("a slots=8\nb slots=4\n")
    hosts = read_hostfile(f)
    assert [(h.name, h.slots) for h in hosts] == [("a", 8), ("b", 4)]
    with pytest.raises(HostfileError, match=rf"{f} lists 2 host\(s\), the stage asks for nodes=3"):
        choose_nodes(hosts, 3, 1, f)
    with pytest.raises(HostfileError, match=rf"{f}:2: b has slots=4, the stage starts 8"):
        choose_nodes(hosts, 2, 8, f)
    f.write_text("a slots=8\na slots=8\n")
    with pytest.raises(HostfileError, match=rf"{f}:2: host 'a' is listed twice"):
        read_hostfile(f)
    f.write_text("a gpus=8\n")
    with pytest.raises(HostfileError, match=rf"{f}:1: expected `hostname slots=N`"):
        read_hostfile(f)
    assert launch_problem(Resources(nodes=2), "torchrun").startswith("nodes=2 needs `hostfile`")
    # exit 2 with the message when the launcher meets it at run time
    with pytest.raises(StageFailed, match="code 2"):
        _launch(tmp_path, Resources(nodes=2, cpu_ranks=1, hostfile=str(tmp_path / "absent")))
    assert "cannot be read" in (tmp_path / "probe.log").read_text()
