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
