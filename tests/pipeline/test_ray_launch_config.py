"""`launcher: ray` without a cluster: the recipe's settings (validated, located, out of the
stage hash), the command `plan` shows, how ranks and GPUs are numbered on a node, and how a
launcher's verdict explains a failed job."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.job_output import JobOutput
from pipeline.launch import build_command
from pipeline.loader import load_recipe
from pipeline.plan import make_plan
from pipeline.ray_launch import Layout, number_ranks, rank_env
from stages.common.contract import RaySettings, Resources
from tests.pipeline.test_recipe import GOOD

RAY = "defaults:\n  launcher: ray\n  resources: {nodes: 2, gpus_per_node: 4}\n  ray: {address: 'ray://head:10001'}\n"


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text.replace("name: t\n", f"name: t\nstorage: {{url: 'file://{tmp_path}/store'}}\n"))
    return path


def test_a_ray_recipe_needs_no_hostfile_and_plan_shows_the_ray_launch(tmp_path):
    path = _recipe(tmp_path, GOOD.replace("stages:\n", RAY + "stages:\n"))
    plan = make_plan(load_recipe(path), check_store=False)
    sft = plan["sft"]
    assert sft.launcher == "ray" and sft.ray.address == "ray://head:10001"
    cmd = build_command(sft.kind.entry, Path("job.json"), sft.resources, sft.launcher, True, sft.ray)
    assert cmd[:3] == [sys.executable, "-m", "pipeline.ray_launch"]
    flags = dict(zip(cmd[3:cmd.index("--")][::2], cmd[3:cmd.index("--")][1::2]))
    assert flags == {"--address": "ray://head:10001", "--nodes": "2", "--gpus-per-node": "4", "--cpu-ranks": "1",
                     "--cpus-per-worker": "1.0", "--placement-timeout": "300.0"}
    assert cmd[cmd.index("--") + 1:] == ["-m", "stages.sft.job", "--job", "job.json"]
    # a data stage still runs as one local process
    assert build_command("stages.synthetic_data.job", Path("j"), sft.resources, "ray", False, sft.ray)[1:3] == \
        ["-m", "stages.synthetic_data.job"]
    res = CliRunner().invoke(app, ["plan", str(path)])
    assert res.exit_code == 0 and "pipeline.ray_launch --address ray://head:10001" in res.output, res.output


def test_the_launcher_and_its_cluster_stay_out_of_the_stage_hash(tmp_path):
    plain = make_plan(load_recipe(_recipe(tmp_path, GOOD)), check_store=False)
    on_ray = make_plan(load_recipe(_recipe(tmp_path, GOOD.replace("stages:\n", RAY + "stages:\n")),
                                   ["stages.sft.ray.cpus_per_worker=4"]), check_store=False)
    assert [s.hash for s in on_ray.stages] == [s.hash for s in plain.stages]


@pytest.mark.parametrize("edit,line,fragment", [
    # Ray places the nodes: a hostfile there is a mistake, named at the stage's resources
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    launcher: ray\n    resources: {nodes: 2, hostfile: /h}\n"), 18,
     "stages.sft.resources: stage 'sft': launcher ray places the nodes itself: remove `hostfile`"),
    # several nodes without a hostfile, for the hostfile launchers, named where the resources come from
    (("stages:\n", "defaults:\n  resources: {nodes: 2}\nstages:\n"), 4,
     "defaults.resources: stage 'sft': nodes=2 needs `hostfile`"),
    (("stages:\n", "defaults:\n  ray: {adress: auto}\nstages:\n"), 4, "defaults.ray.adress: unknown key"),
    (("stages:\n", "defaults:\n  ray: {placement_timeout_s: 0}\nstages:\n"), 4,
     "defaults.ray.placement_timeout_s: Input should be greater than 0"),
    # addresses Ray cannot join, named where they are written, not at plan or launch time
    (("stages:\n", "defaults:\n  ray: {address: 'http://head:8265'}\nstages:\n"), 4,
     "defaults.ray.address: Value error, this looks like the Ray dashboard / job-submission address"),
    (("stages:\n", "defaults:\n  ray: {address: 'HTTPS://head:8265'}\nstages:\n"), 4,
     "defaults.ray.address: Value error, this looks like the Ray dashboard / job-submission address (what `ray "
     "job submit` uses, port 8265), which runs no stage: give the cluster's GCS address host:6379 or its Ray "
     "Client address ray://host:10001 (got 'HTTPS://head:8265')"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: '::1:6379'}\n"), 17,
     "stages.sft.ray.address: Value error, an IPv6 host goes in brackets ([::1]:6379)"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: '[fe80::zz]:6379'}\n"), 17,
     "stages.sft.ray.address: Value error, [fe80::zz] is not an IPv6 address"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: '[::1]'}\n"), 17,
     "stages.sft.ray.address: Value error, no port after the bracketed IPv6 host"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: 'ray://head'}\n"), 17,
     "stages.sft.ray.address: Value error, no host:port; expected auto, host:port or ray://host:port"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: 'head:65536'}\n"), 17,
     "stages.sft.ray.address: Value error, the port '65536' is not a number from 1 to 65535"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: 'head:0'}\n"), 17,
     "stages.sft.ray.address: Value error, the port '0' is not a number"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: 'ray://head:10001/'}\n"), 17,
     "stages.sft.ray.address: Value error, the port '10001/' is not a number"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: 'head node:6379'}\n"), 17,
     "stages.sft.ray.address: Value error, 'head node' is not a host name or IP address"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: 'grpc://head:6379'}\n"), 17,
     "stages.sft.ray.address: Value error, unknown scheme grpc://"),
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: ''}\n"), 17,
     "stages.sft.ray.address: Value error, no host:port"),
    # `local` would start a cluster of its own inside the launcher: one machine, no stage's nodes
    (("    lr: 1.0e-3\n", "    lr: 1.0e-3\n    ray: {address: local}\n"), 17,
     "stages.sft.ray.address: Value error, no host:port"),
])
def test_launch_settings_that_cannot_work_are_located(tmp_path, edit, line, fragment):
    res = CliRunner().invoke(app, ["validate", str(_recipe(tmp_path, GOOD.replace(*edit)))])
    assert res.exit_code == 2, res.output
    assert f"r.yaml:{line}: {fragment}" in res.output, res.output


def test_ranks_are_numbered_node_by_node_and_local_ranks_follow_the_gpus(tmp_path):
    layout = Layout(nodes=2, gpus_per_node=2, cpu_ranks=1, cpus_per_worker=1.0)
    def where(node: str, gpu: str) -> dict:
        return {"node_id": node * 8, "ip": "10.0.0.2" if node == "b" else "10.0.0.1", "host": node, "pid": 1,
                "gpus": [gpu]}

    # Ray handed out the GPUs in no particular order, and bundle 1's actors came back first
    placed = [(1, "b-x", where("b", "7")), (1, "b-y", where("b", "6")), (0, "a-x", where("a", "3")),
              (0, "a-y", where("a", "1"))]
    workers = number_ranks(layout, placed)
    assert [(w.rank, w.local_rank, w.node_rank, w.actor) for w in workers] == \
        [(0, 0, 0, "a-y"), (1, 1, 0, "a-x"), (2, 0, 1, "b-y"), (3, 1, 1, "b-x")]
    env = rank_env(workers[3], workers, layout, ("10.0.0.1", 29500))
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["LOCAL_RANK"] == "1"  # cuda:1 is GPU 7
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"]) == ("3", "4", "2", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    cpu = Layout(nodes=2, gpus_per_node=0, cpu_ranks=3, cpus_per_worker=0.5)
    assert cpu.bundle() == {"CPU": 1.5} and layout.bundle() == {"CPU": 2.0, "GPU": 2.0}
    cpu_workers = number_ranks(cpu, [(b, f"{b}{i}", where("a", "")) for b in (0, 1) for i in range(3)])
    assert rank_env(cpu_workers[4], cpu_workers, cpu, ("h", 1))["CUDA_VISIBLE_DEVICES"] == ""


def test_the_launchers_verdict_explains_a_crash_but_not_a_user_error():
    lines = ["[rank0]: Traceback (most recent call last):", "[rank0]:   File \"x.py\", line 1, in f",
             "[rank0]: RuntimeError: Connection reset by peer",
             "[launcher] worker rank 1 (node b 10.0.0.2, Ray node d664ae97, pid 7) failed first: "
             "its job exited with code 137 (killed by SIGKILL)"]
    out = JobOutput("sft", "sft")
    for line in lines:
        out.feed(line)
    failure = out.failure(137)
    assert failure.reason.startswith("worker rank 1 (node b 10.0.0.2") and "SIGKILL" in failure.reason
    assert not failure.user_error
    out = JobOutput("sft", "sft")
    for line in ["[rank1]: [rank 1] sft (sft) failed: shard 3 is corrupt", lines[-1]]:
        out.feed(line)
    assert out.failure(2).reason == "[rank 1] shard 3 is corrupt" and out.failure(2).user_error


def test_ray_settings_defaults():
    assert RaySettings().address == "auto"
    assert Resources(nodes=3).world_size == 3  # the hostfile check moved to where the launcher is known


def test_ring1t_on_ray_is_ring1t_with_another_launcher(no_aws_credentials):
    """(Without credentials, the cluster's s3:// inputs are unreachable at once: with the suite's
    moto credentials in the environment each one waited out botocore's retries, 2 min in all.)"""
    from tests.conftest import REPO

    on_ray = make_plan(load_recipe(REPO / "recipes" / "ring1t-ray.yaml"), check_store=False)
    hostfile = make_plan(load_recipe(REPO / "recipes" / "ring1t.yaml"), check_store=False)
    assert [(s.name, s.hash) for s in on_ray.stages] == [(s.name, s.hash) for s in hostfile.stages]
    sft = on_ray["sft"]
    assert sft.launcher == "ray" and sft.resources.world_size == 256 and sft.resources.hostfile is None
    assert on_ray["curate"].launcher == "ray"  # a data stage: still one local process (build_command)


@pytest.mark.parametrize("address,fragment", [
    ("127.0.0.1:{port}", "nothing answers at 127.0.0.1:{port}"),   # a cluster that is not up: at once, not in minutes
    ("head-without-port", "expected auto, host:port or ray://host:port"),
    # auto joins $RAY_ADDRESS, whose absent GCS Ray's client would retry for minutes
    ("auto", "ray.address auto is $RAY_ADDRESS '127.0.0.1:{port}': cannot connect"),
])
def test_an_address_without_a_cluster_fails_at_once_as_the_users_error(tmp_path, address, fragment,
                                                                       unreachable_port):
    import os
    import subprocess

    port = unreachable_port
    job = tmp_path / "job.json"
    job.write_text('{"stage": "sft", "kind": "sft", "stage_url": "file:///x", "output_dir": "/o", "work_dir": "/w"}')
    out = subprocess.run([sys.executable, "-m", "pipeline.ray_launch", "--address", address.format(port=port),
                          "--nodes", "2", "--", "-c", "pass", "--job", str(job)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert out.returncode == 2
    assert out.stderr.startswith("sft (sft) failed: ") and fragment.format(port=port) in out.stderr, out.stderr
    output = JobOutput("sft", "sft")
    for line in out.stderr.splitlines():
        output.feed(line)
    assert output.failure(2).user_error


def test_each_node_gets_a_scratch_dir_of_its_own_and_the_same_outputs():
    import json

    from pipeline.ray_launch import node_job, with_job

    text = json.dumps({"stage": "sft", "work_dir": "/w/a/scratch", "output_dir": "/w/a/output"})
    path, node1 = node_job("/w/a/job.json", text, 1)
    assert path == "/w/a/job-node1.json"
    assert json.loads(node1) == {"stage": "sft", "work_dir": "/w/a/scratch/node1", "output_dir": "/w/a/output"}
    assert with_job(["-m", "stages.sft.job", "--job", "/w/a/job.json", "--x"], path) == \
        ["-m", "stages.sft.job", "--job", "/w/a/job-node1.json", "--x"]


@pytest.mark.parametrize("address", ["auto", "head:6379", "10.0.0.1:6379", "ray://head-0.ray.svc:10001",
                                     "[::1]:6379", "ray://[fd00::1]:10001", "h_1:1", "h:65535"])
def test_addresses_ray_can_join_load(tmp_path, address):
    res = CliRunner().invoke(app, ["validate", str(_recipe(tmp_path, GOOD.replace(
        "stages:\n", f"defaults:\n  ray: {{address: '{address}'}}\nstages:\n")))])
    assert res.exit_code == 0, res.output


def test_a_dashboard_address_from_the_environment_is_named_at_the_recipe_line(tmp_path, monkeypatch):
    """recipes/ring1t-ray.yaml takes its address from $RAY_ADDRESS, which `ray job submit` users
    set to the dashboard's http:// address."""
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    text = GOOD.replace("stages:\n", "defaults:\n  ray: {address: '${env:RAY_ADDRESS:-auto}'}\nstages:\n")
    res = CliRunner().invoke(app, ["validate", str(_recipe(tmp_path, text))])
    assert res.exit_code == 2, res.output
    assert "r.yaml:4: defaults.ray.address: Value error, this looks like the Ray dashboard" in res.output, res.output
    assert "(got '${env:RAY_ADDRESS}')" in res.output  # the variable, not its value (it could be a secret's)


@pytest.fixture
def ray_home(tmp_path, monkeypatch):
    """This machine's Ray temp dir (where `ray start` records the head's address) in tmp_path,
    no $RAY_ADDRESS, and no Ray GCS process running here as far as Ray's `auto` can tell: another
    test's cluster on this machine would be the one Ray picks, not the recorded address."""
    import ray._private.services as services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset())
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray" / "ray_current_cluster"


def _refused(address: str) -> str:
    import time

    from pipeline.ray_launch import LaunchError, check_reachable

    started = time.monotonic()
    with pytest.raises(LaunchError) as e:
        check_reachable(address)
    assert time.monotonic() - started < 5, "waited on a cluster that is not there"
    return str(e.value)


@pytest.mark.parametrize("env_address", [None, "auto"])
def test_auto_with_the_address_of_a_crashed_head_fails_at_once_naming_the_file(ray_home, monkeypatch,
                                                                               unreachable_port, env_address):
    """A head that crashed leaves `ray start`'s address file behind; ray.init("auto") retries its
    address for minutes ($RAY_ADDRESS=auto is the same to Ray)."""
    if env_address:
        monkeypatch.setenv("RAY_ADDRESS", env_address)
    ray_home.write_text(f"127.0.0.1:{unreachable_port}\n")
    message = _refused("auto")
    assert message.startswith(f"ray.address auto is Ray's recorded address ({ray_home}, written by the last "
                              f"`ray start` on this machine) '127.0.0.1:{unreachable_port}': cannot connect"), message
    assert f"nothing answers at 127.0.0.1:{unreachable_port}" in message
    assert "start it again (`ray start --head`), or set ray.address" in message


def test_auto_follows_rays_choice_of_a_running_gcs_over_the_recorded_address(ray_home, monkeypatch,
                                                                             unreachable_port):
    import socket

    import ray._private.services as services

    from pipeline.ray_launch import check_reachable

    ray_home.write_text(f"127.0.0.1:{unreachable_port}")
    with socket.create_server(("127.0.0.1", 0)) as gcs:  # one GCS running here: Ray joins it
        live = f"127.0.0.1:{gcs.getsockname()[1]}"
        monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset({live}))
        check_reachable("auto")
    message = _refused("auto")  # ... and once it is gone, its address is not answered either
    assert message.startswith(f"ray.address auto is the address of the Ray GCS process running on this machine "
                              f"'{live}': cannot connect"), message


def test_auto_without_a_recorded_cluster_is_left_to_ray(ray_home, monkeypatch, unreachable_port):
    """No cluster here: ray.init says so at once. A Ray without the resolution functions (they
    are private) is not checked here, as before; a recorded garbage address is named."""
    import ray._private.services as services

    from pipeline.ray_launch import check_reachable

    check_reachable("auto")
    monkeypatch.setenv("RAY_ADDRESS", "local")  # Ray starts a cluster of its own
    ray_home.write_text(f"127.0.0.1:{unreachable_port}")
    check_reachable("auto")
    monkeypatch.delenv("RAY_ADDRESS")
    with monkeypatch.context() as older_ray:
        older_ray.delattr(services, "get_ray_address_from_environment")
        check_reachable("auto")
    ray_home.write_text("http://head:8265")
    assert "'http://head:8265': this looks like the Ray dashboard" in _refused("auto")


@pytest.mark.parametrize("env_address,fragment", [
    # `ray job submit` users export the dashboard's address
    ("http://127.0.0.1:8265", "ray.address auto is $RAY_ADDRESS 'http://127.0.0.1:8265': this looks like the Ray "
     "dashboard / job-submission address"),
    ("[::1]:{port}", "ray.address auto is $RAY_ADDRESS '[::1]:{port}': cannot connect to the Ray cluster there: "
     "nothing answers at [::1]:{port} ("),
    ("ray://[::1]:{port}", "nothing answers at [::1]:{port} ("),
    ("::1:{port}", "$RAY_ADDRESS '::1:{port}': an IPv6 host goes in brackets ([::1]:{port})"),
    ("head", "ray.address auto is $RAY_ADDRESS 'head': no host:port"),
])
def test_ray_address_in_the_environment_gets_the_recipes_checks_and_is_named(monkeypatch, unreachable_port,
                                                                            env_address, fragment):
    monkeypatch.setenv("RAY_ADDRESS", env_address.format(port=unreachable_port))
    message = _refused("auto")
    assert fragment.format(port=unreachable_port) in message, message
    assert "Name or service not known" not in message
    if "cannot connect" in message:
        assert message.endswith("Else fix or unset the environment variable RAY_ADDRESS, or set ray.address")
