"""benchmarks/gpu_queue.py: jobs get GPUs of their own, wait for dependencies and files, and a
failed or hung job neither blocks the rest nor lets its dependents run."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_queue_places_orders_and_contains_failures(tmp_path):
    flag = tmp_path / "payload-ready"
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"""jobs:
  - {{name: one, gpus: 1, cmd: 'echo "$CUDA_VISIBLE_DEVICES" > $OUT/gpus; touch {flag}; sleep 1'}}
  - {{name: broken, gpus: 2, cmd: 'exit 3'}}
  - {{name: after_broken, gpus: 1, cmd: 'touch $OUT/ran', after: [broken]}}
  - {{name: hung, gpus: 1, cmd: 'sleep 60', timeout_s: 1}}
  - {{name: wide, gpus: 3, cmd: 'echo "$CUDA_VISIBLE_DEVICES" > $OUT/gpus', after: [one], needs_file: '{flag}'}}
""")
    res = tmp_path / "res"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_queue.py"), str(plan), "--results", str(res),
                    "--gpus", "3"], check=True, timeout=60)
    jobs = {j["name"]: j for j in json.loads((res / "queue.json").read_text())["jobs"]}
    assert {n: j["state"] for n, j in jobs.items()} == {
        "one": "ok", "broken": "failed", "after_broken": "skipped", "hung": "timeout", "wide": "ok"}
    assert (res / "one" / "gpus").read_text().strip() == "0"
    # two jobs at once never share a GPU: 'one' and 'broken' started together on 3 GPUs
    assert jobs["broken"]["gpus"] == [1, 2] and jobs["hung"]["exit_code"] == -9
    assert (res / "wide" / "gpus").read_text().strip() == "0,1,2" and not (res / "after_broken" / "ran").exists()


def test_a_sharing_job_runs_beside_the_holder_and_frees_nothing(tmp_path):
    """`shares: true` starts on GPU 0 while another job holds it, and its end does not hand
    GPU 0 to a waiting job while the holder still runs."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("""jobs:
  - {name: holder, gpus: 1, cmd: 'sleep 3; date +%s.%N > $OUT/end'}
  - {name: sharer, gpus: 1, shares: true, cmd: 'echo "$CUDA_VISIBLE_DEVICES" > $OUT/gpus; date +%s.%N > $OUT/end'}
  - {name: waiter, gpus: 1, cmd: 'date +%s.%N > $OUT/start'}
""")
    res = tmp_path / "res"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_queue.py"), str(plan), "--results", str(res),
                    "--gpus", "1"], check=True, timeout=60)
    jobs = {j["name"]: j for j in json.loads((res / "queue.json").read_text())["jobs"]}
    assert {n: j["state"] for n, j in jobs.items()} == {"holder": "ok", "sharer": "ok", "waiter": "ok"}
    assert (res / "sharer" / "gpus").read_text().strip() == "0"
    t = {n: float((res / n / f).read_text()) for n, f in (("holder", "end"), ("sharer", "end"), ("waiter", "start"))}
    assert t["sharer"] < t["holder"] <= t["waiter"]


def _check(plan: Path, gpus: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_queue.py"), str(plan), "--results",
                           "/nonexistent", "--gpus", str(gpus), "--check"], capture_output=True, text=True, timeout=60)


def test_a_plan_with_a_command_bash_cannot_parse_is_refused_before_anything_runs(tmp_path):
    """A folded YAML block keeps the line break of a deeper-indented line: a `for` list split
    that way is a bash syntax error, found when the plan loads, not when the job's GPUs are held."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("""jobs:
  - name: decode
    gpus: 1
    cmd: >-
      for a in "--batch 256"
               "--batch 64"; do echo $a; done
""")
    out = _check(plan, 1)
    assert out.returncode != 0 and "job 'decode': its cmd is not valid bash" in out.stderr
    plan.write_text(plan.read_text().replace('               "--batch 64"', '      "--batch 64"'))
    assert _check(plan, 1).returncode == 0


def test_every_committed_plan_is_valid():
    plans = sorted((ROOT / "benchmarks" / "gpu_plans").glob("*.yaml"))
    assert plans
    for plan in plans:
        out = _check(plan, 8)
        assert out.returncode == 0, f"{plan.name}: {out.stderr}"


# A stand-in for nvidia-smi (this machine has none): answers the host queries, refuses the new
# name of the slowdown-reasons field as a pre-535 driver does, and in loop mode prints one line
# per requested GPU every 0.1 s, GPU 1 capped by power from its third sample on.
FAKE_NVIDIA_SMI = r'''#!/usr/bin/env python3
import sys, time
args = " ".join(sys.argv[1:])
if "clocks_event_reasons" in args:
    sys.exit('Field "clocks_event_reasons.active" is not a valid field to query.')
if args.startswith("topo"):
    print("        GPU0    GPU1\nGPU0     X      NV18\nGPU1    NV18     X"); sys.exit()
if "--query-gpu=index,name" in args or "--query-compute-apps" in args:
    print("index, name\n0, FAKE H200"); sys.exit()
ids = [a.split("=")[1] for a in sys.argv if a.startswith("--id=")]
ids = ids[0].split(",") if ids else ["0", "1"]
n = 0
while True:
    for i in ids:
        capped = i == "1" and n >= 2
        clock = 1500 if capped else 1980
        print(f"{i}, {clock}, 3201, {700 if capped else 650}.5, {60 + n}, 97, 81000, {'0x0000000000000004' if capped else '0x0000000000000000'}",
              flush=True)
    if "--loop-ms" not in args:
        break
    n += 1
    time.sleep(0.1)
'''


def _queue_with_path(tmp_path: Path, path_dirs: list[str]) -> dict:
    plan = tmp_path / "plan.yaml"
    plan.write_text("""jobs:
  - {name: timed, gpus: 2, cmd: 'sleep 1.5'}
  - {name: sharer, gpus: 1, shares: true, cmd: 'true'}
""")
    res = tmp_path / "res"
    env = {"PATH": ":".join(path_dirs)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_queue.py"), str(plan), "--results", str(res),
                    "--gpus", "2"], check=True, timeout=60, env=env)
    return {"res": res, "jobs": {j["name"]: j for j in json.loads((res / "queue.json").read_text())["jobs"]},
            "host": json.loads((res / "host.json").read_text())}


def test_each_job_records_its_gpus_clocks_and_slowdowns_and_the_run_its_host(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI.replace("/usr/bin/env python3", sys.executable))
    fake.chmod(0o755)
    got = _queue_with_path(tmp_path, [str(bin_dir), "/usr/bin", "/bin"])
    assert "NV18" in got["host"]["topology"] and "FAKE H200" in got["host"]["gpus"]
    timed = got["jobs"]["timed"]["telemetry"]
    assert set(timed) == {"0", "1"} and timed["0"]["samples"] >= 5
    assert timed["0"]["sm_clock_mhz_median"] == 1980 and timed["0"]["slowdown_fraction"] == 0
    assert timed["1"]["sm_clock_mhz_min"] == 1500 and timed["1"]["slowdown_reasons"] == ["sw_power_cap"]
    assert 0.5 < timed["1"]["slowdown_fraction"] < 1 and timed["1"]["power_w_median"] == 700.5
    assert "clocks_throttle_reasons.active" in (got["res"] / "timed" / "gpu_telemetry.csv").read_text()
    # a job beside a holder samples nothing: its GPUs' figures belong to the holder
    assert got["jobs"]["sharer"]["telemetry"] is None


def test_without_nvidia_smi_the_jobs_run_and_say_why_there_is_no_telemetry(tmp_path):
    got = _queue_with_path(tmp_path, ["/usr/bin", "/bin"])
    assert got["jobs"]["timed"]["state"] == "ok"
    assert got["jobs"]["timed"]["telemetry"] == {"unavailable": "unavailable: nvidia-smi not found"}
    assert got["host"]["topology"].startswith("unavailable")


def test_a_sampler_whose_loop_fails_says_what_nvidia_smi_said(tmp_path, monkeypatch):
    """The one-shot query works, the loop exits at once with an error: no empty summary that reads
    as "no GPU slowed", but nvidia-smi's own words."""
    from benchmarks.gpu_telemetry import GpuSampler, query_fields

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!{sys.executable}\nimport sys\nif '--loop-ms' in ' '.join(sys.argv):\n"
                    "    sys.exit('Invalid combination of input arguments.')\nprint('0, 1980')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    sampler = GpuSampler([0], tmp_path / "t.csv", query_fields())
    sampler.proc.wait(timeout=10)
    assert sampler.stop() == {"unavailable": "no samples; nvidia-smi said: Invalid combination of input arguments."}
