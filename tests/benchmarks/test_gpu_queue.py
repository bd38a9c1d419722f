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
