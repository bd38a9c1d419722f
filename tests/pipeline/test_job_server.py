"""CPU jobs forked from the launching process's warm server (pipeline.job_server), through the
public launch path: what a job sees is what a fresh `python -m` under its guard saw (argv, cwd,
its own and its credentials' variables, its session, stdin, output, exit status, process title),
a stop or the launcher's death takes the job down, a changed environment gets a new server, and
`RING_WARM_JOBS=off` starts every job cold. The stage tests run their CPU stages through it too.
The tests of servers made for other environments have them warm a light module
(`RING_WARM_MODULES`) instead of torch and transformers: ~11 CPU-s a server saved, same paths."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pipeline import warm_jobs
from pipeline.interrupt import StageInterrupted
from pipeline.launch import launch_job
from stages.common.compile_layers import BACKEND_ENV
from stages.common.contract import Resources, StageFailed
from stages.common.fused_loss import LOSS_COMPILE_ENV

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROBE = [sys.executable, "-m", "tests.pipeline.warm_probe"]
ONE = Resources(cpu_ranks=1)
LIGHT = "email.mime.text"  # a module no job here imports by itself


@pytest.fixture(autouse=True)
def _not_the_first_launch(tmp_path_factory) -> None:
    """The first CPU job a process launches starts cold (test_the_first_job_starts_cold...): the
    tests here are about the later ones, whatever ran in this process before."""
    launch_job([*PROBE, "ok"], "probe", tmp_path_factory.mktemp("first") / "first.log", ONE)


def _facts(log: Path) -> dict:
    line = next(ln for ln in log.read_text().splitlines() if ln.startswith("FACTS "))
    return json.loads(line.removeprefix("FACTS "))


def _server_of(facts: dict) -> psutil.Process:
    """The process the job's guard was forked from (it outlives the job)."""
    return psutil.Process(facts["guard_parent"])


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_cpu_jobs_are_forked_from_one_warm_server_and_see_what_a_fresh_process_would(tmp_path, monkeypatch):
    seen = []
    # the compile backend is read when the job runs, not by an import: it needs no server of its own
    for i, (credential, backend) in enumerate([("first", "inductor"), ("second", "aot_eager")]):
        monkeypatch.setenv(BACKEND_ENV, backend)
        log = tmp_path / f"job{i}.log"
        launch_job([*PROBE, "ok", f"n={i}"], "probe", log, ONE, extra_env={"WARM_CREDENTIAL": credential},
                   cwd=str(tmp_path), tracked=True)
        seen.append(_facts(log))
        assert "a line on stderr" in log.read_text()
    first, second = seen
    assert first["torch_at_start"] and second["torch_at_start"]  # forked from a warm process
    assert first["mlflow_store_at_start"]  # a server for tracked jobs: what rank 0 logs with, warm too
    assert [first["argv"], second["argv"]] == [["ok", "n=0"], ["ok", "n=1"]]
    assert first["cwd"] == second["cwd"] == str(tmp_path) and first["main"] == "__main__"
    # a credential is the job's own variable: both jobs came from the same server
    assert [first["credential"], second["credential"]] == ["first", "second"]
    assert [first["compile_backend"], second["compile_backend"]] == ["inductor", "aot_eager"]
    server = _server_of(first)
    assert server.pid == _server_of(second).pid and server.ppid() == os.getpid()
    assert "pipeline.job_server" in " ".join(server.cmdline())
    for facts in seen:  # the guard leads the job's own session and group, as Popen(start_new_session) did
        assert facts["sid"] == facts["pgid"] == facts["ppid"] != os.getsid(0)
        assert facts["stdin"] == ""
        assert facts["title"].startswith(f"{sys.executable} -m tests.pipeline.warm_probe ok")
        # the job's OMP_NUM_THREADS (not the server's: it has none), as a fresh torch reads it
        assert facts["omp"] and facts["threads"] == int(facts["omp"])


def test_the_compile_switches_are_per_job_variables():
    """They are read when a model is compiled, never by an import: a job that sets them needs no
    server of its own (warm_jobs keeps their names as strings, to import nothing of the stages)."""
    assert {BACKEND_ENV, LOSS_COMPILE_ENV} <= warm_jobs.PER_JOB_VARIABLES


def test_a_jobs_failure_is_its_exit_status_and_its_message(tmp_path):
    with pytest.raises(StageFailed, match="exited with code 3") as failed:
        launch_job([*PROBE, "exit3"], "probe", tmp_path / "exit.log", ONE)
    assert failed.value.exit_code == 3
    with pytest.raises(StageFailed, match="ValueError: the warm probe failed") as failed:
        launch_job([*PROBE, "raise"], "probe", tmp_path / "raise.log", ONE)
    assert failed.value.exit_code == 1
    # the traceback starts at the job's own frame: no frame of the server that forked it
    traceback = (tmp_path / "raise.log").read_text().split("Traceback (most recent call last):\n", 1)[1]
    assert traceback.startswith(f'  File "{REPO}/tests/pipeline/warm_probe.py", line'), traceback
    assert "job_server" not in traceback and "runpy" not in traceback
    with pytest.raises(StageFailed) as failed:  # as the guard reports a killed command: 128 + 9
        launch_job([*PROBE, "kill"], "probe", tmp_path / "kill.log", ONE)
    assert failed.value.exit_code == 128 + signal.SIGKILL


def test_a_stop_takes_the_job_down(tmp_path):
    log = tmp_path / "stop.log"

    def must_stop() -> str | None:
        return "told to" if log.exists() and "FACTS " in log.read_text() else None

    with pytest.raises(StageInterrupted, match="told to"):
        launch_job([*PROBE, "sleep"], "probe", log, ONE, must_stop=must_stop)
    facts = _facts(log)
    assert _gone(facts["pid"]) and _gone(facts["ppid"])
    assert not _gone(facts["guard_parent"])  # the server outlives a stopped job: the next one is forked from it


def test_an_environment_an_import_may_read_gets_a_server_of_its_own(tmp_path, monkeypatch):
    """One server per environment, the two most recently used kept: a third environment ends the
    least recently used one."""
    servers = []
    monkeypatch.setenv("RING_WARM_MODULES", LIGHT)
    for i, value in enumerate("abac"):
        monkeypatch.setenv("WARM_PROBE", value)
        log = tmp_path / f"{i}.log"
        launch_job([*PROBE, "ok"], "probe", log, ONE)
        facts = _facts(log)
        assert facts["variable"] == value and facts["email_at_start"] and not facts["torch_at_start"]
        servers.append(facts["guard_parent"])
    a, b, a_again, c = servers
    assert a == a_again and len({a, b, c}) == 3
    assert _gone(b) and not _gone(a) and not _gone(c)


def test_a_variable_the_servers_imports_set_does_not_make_a_new_server(tmp_path, monkeypatch):
    """An import in the launching process sets a variable after its server started: the same
    import did so in the server, so its jobs keep their server; another value gets another one."""
    monkeypatch.setenv("RING_WARM_MODULES", f"{LIGHT},tests.pipeline.sets_variable")
    monkeypatch.delenv("WARM_SET_BY_IMPORT", raising=False)
    servers = []
    for name, value in (("before", None), ("same", "set by the import"), ("other", "set otherwise")):
        if value:
            monkeypatch.setenv("WARM_SET_BY_IMPORT", value)
        launch_job([*PROBE, "ok"], "probe", tmp_path / f"{name}.log", ONE)
        servers.append(_facts(tmp_path / f"{name}.log")["guard_parent"])
    assert servers[0] == servers[1] != servers[2] and os.getpid() not in servers


def test_a_new_server_lets_the_old_ones_running_job_finish(tmp_path, monkeypatch):
    """The server of a running job is replaced (two other environments came since): the job
    finishes as it would have, then its server ends."""
    done, first_log = tmp_path / "done", tmp_path / "first.log"
    outcome: dict = {}

    def first() -> None:
        try:
            outcome["result"] = launch_job([*PROBE, "wait", str(done)], "probe", first_log, ONE)
        except BaseException as e:  # noqa: BLE001 - the test's thread reports it
            outcome["error"] = e

    monkeypatch.setenv("RING_WARM_MODULES", LIGHT)
    monkeypatch.setenv("WARM_PROBE", "old")
    worker = threading.Thread(target=first)
    worker.start()
    deadline = time.time() + 180
    while not (first_log.exists() and "FACTS " in first_log.read_text()):
        assert worker.is_alive() and time.time() < deadline, outcome
        time.sleep(0.1)
    old_server = _facts(first_log)["guard_parent"]
    for value in ("new", "newer"):  # two other environments: the old server is the least recently used
        monkeypatch.setenv("WARM_PROBE", value)
        launch_job([*PROBE, "ok"], "probe", tmp_path / f"{value}.log", ONE)
        assert _facts(tmp_path / f"{value}.log")["guard_parent"] != old_server
    assert worker.is_alive() and not _gone(old_server)
    done.touch()
    worker.join(timeout=60)
    assert outcome.get("result") is not None and outcome["result"].returncode == 0, outcome
    assert _gone(old_server)


def test_the_first_job_starts_cold_and_the_server_dies_with_the_launching_process(tmp_path):
    """In a process of its own: its first CPU job starts as a process of its own (a server pays
    from the second job on), the second is forked from the server; kill -9 of that process takes
    the server and its running job down."""
    cold, log = tmp_path / "cold.log", tmp_path / "warm.log"
    script = ("import sys\nfrom pathlib import Path\nfrom pipeline.launch import launch_job\n"
              "from stages.common.contract import Resources\n"
              f"launch_job({[*PROBE, 'ok']!r}, 'probe', Path({str(cold)!r}), Resources(cpu_ranks=1))\n"
              f"launch_job({[*PROBE, 'sleep']!r}, 'probe', Path({str(log)!r}), Resources(cpu_ranks=1))\n")
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO), "RING_WARM_MODULES": LIGHT})
    try:
        deadline = time.time() + 180
        while not (log.exists() and "FACTS " in log.read_text()):
            assert launcher.poll() is None and time.time() < deadline, "the job did not start"
            time.sleep(0.2)
        first, facts = _facts(cold), _facts(log)
        assert not first["email_at_start"] and first["guard_parent"] == launcher.pid
        assert facts["email_at_start"] and psutil.Process(facts["guard_parent"]).ppid() == launcher.pid
        server = facts["guard_parent"]
        launcher.kill()  # kill -9: nothing of it runs
        launcher.wait()
        deadline = time.time() + 30
        while not all(_gone(p) for p in (server, facts["ppid"], facts["pid"])):
            assert time.time() < deadline, "the server or its job outlived the launching process"
            time.sleep(0.2)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_the_modules_a_server_warms_can_be_chosen_and_one_that_cannot_be_imported_is_named(
        tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("RING_WARM_MODULES", f" {LIGHT}, no_such_module_here ,")
    launch_job([*PROBE, "ok"], "probe", tmp_path / "chosen.log", ONE)
    facts = _facts(tmp_path / "chosen.log")
    assert facts["email_at_start"] and not facts["torch_at_start"]
    warning = capfd.readouterr().err
    assert "RING_WARM_MODULES" in warning and "no_such_module_here" in warning and LIGHT not in warning
    monkeypatch.setenv("RING_WARM_MODULES", "")  # none: a server that only forks
    launch_job([*PROBE, "ok"], "probe", tmp_path / "none.log", ONE)
    facts = _facts(tmp_path / "none.log")
    assert not facts["email_at_start"] and not facts["torch_at_start"]
    assert facts["guard_parent"] != os.getpid() and "RING_WARM_MODULES" not in capfd.readouterr().err


def test_a_server_whose_imports_start_a_thread_refuses_and_jobs_start_cold(tmp_path, monkeypatch, capfd):
    """A fork copies only its calling thread: a warm import that starts a thread (an MLflow release
    whose telemetry did) makes the server refuse, said on stderr, and the process's jobs start cold."""
    monkeypatch.setattr(warm_jobs, "_broken", None)  # restored after: this worker's later jobs stay warm
    monkeypatch.setenv("RING_WARM_MODULES", f"{LIGHT},tests.pipeline.threaded_import")
    for name in ("refused", "after"):
        launch_job([*PROBE, "ok"], "probe", tmp_path / f"{name}.log", ONE)
        facts = _facts(tmp_path / f"{name}.log")
        assert facts["guard_parent"] == os.getpid() and not facts["email_at_start"]  # cold: no server between
    warning = capfd.readouterr().err
    assert warning.count("the warm job server did not start") == 1, warning  # said once, not at every job
    assert "its imports started threads (started-at-import)" in warning and "RING_WARM_MODULES" in warning


def test_switched_off_every_job_starts_as_its_own_process(tmp_path, monkeypatch):
    monkeypatch.setenv(warm_jobs.SWITCH, "off")
    launch_job([*PROBE, "ok"], "probe", tmp_path / "cold.log", ONE)
    facts = _facts(tmp_path / "cold.log")
    assert not facts["torch_at_start"]
    assert facts["guard_parent"] == os.getpid()  # its guard is our child, no server between
