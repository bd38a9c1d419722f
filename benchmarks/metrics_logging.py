"""How long a training step waits for its metrics to reach MLflow: `StageLogger.metrics` (the
batch handed to its sender thread, stages.common.stage_log.MetricSender) against the synchronous `log_batch` it made before,
both into a real MLflow tracking server over HTTP on this machine.

    python benchmarks/metrics_logging.py [--steps 50] [--metrics 12] [--step-ms 300] [--out OUT]

A stage's rank 0 logs every `log_every` steps (default 1) after the step's closing device sync,
so whatever the call takes, the GPU idles for it. Calls are `--step-ms` apart (the step's own
work, not timed; 0: back to back, where a server slower than the calls fills the in-flight window
and `metrics` waits for it). Prints the median and max milliseconds per call and writes
OUT/metrics_logging.json. A remote server adds its round trip to the synchronous figure, not to
the other.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._record import log  # noqa: E402 - needs ROOT on sys.path
from stages.common.ports import reserved_port  # noqa: E402


def serve(work: Path) -> tuple[subprocess.Popen, str]:
    """An MLflow tracking server (sqlite store) on a free port, answering."""
    with reserved_port() as port:  # until the server listens on it
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                 "--backend-store-uri", f"sqlite:///{work}/mlflow.db",
                                 "--default-artifact-root", f"file://{work}/artifacts"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        return proc, _wait_until_answering(proc, f"http://127.0.0.1:{port}")


def _wait_until_answering(proc: subprocess.Popen, uri: str) -> str:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=5).read()
            return uri
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"mlflow server exited with {proc.returncode}") from None
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("mlflow server did not answer in 300 s")


def timed_calls(call, steps: int, step_ms: float) -> list[float]:
    out = []
    for step in range(1, steps + 1):
        time.sleep(step_ms / 1e3)  # the step's work
        t0 = time.perf_counter()
        call(step)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--metrics", type=int, default=12, help="metrics per step (sft logs ~9, the RL stages ~30)")
    p.add_argument("--step-ms", type=float, default=300.0, help="the time between calls (a training step)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    a = p.parse_args()
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from stages.common.stage_log import StageLogger

    with tempfile.TemporaryDirectory() as tmp:
        proc, uri = serve(Path(tmp))
        try:
            client = MlflowClient(uri)
            exp = client.create_experiment("bench")
            values = {f"m{i}": float(i) for i in range(a.metrics)}
            sync_run = client.create_run(exp).info.run_id
            sync_ms = timed_calls(lambda step: client.log_batch(
                sync_run, metrics=[Metric(k, v, int(time.time() * 1000), step) for k, v in values.items()],
                synchronous=True), a.steps, a.step_ms)
            logger = StageLogger(uri, client.create_run(exp).info.run_id)
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # the [metrics] lines
                async_ms = timed_calls(lambda step: logger.metrics(step, values), a.steps, a.step_ms)
                t0 = time.perf_counter()
                logger.flush()
                flush_ms = (time.perf_counter() - t0) * 1e3
            logged = len(client.get_metric_history(logger.run_id, "m0"))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the server's workers too (its own session)
    import mlflow

    result = {"steps": a.steps, "metrics_per_step": a.metrics, "step_ms": a.step_ms, "mlflow": mlflow.__version__,
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "sync_ms_median": statistics.median(sync_ms), "sync_ms_max": max(sync_ms),
              "stage_logger_ms_median": statistics.median(async_ms), "stage_logger_ms_max": max(async_ms),
              "final_flush_ms": flush_ms, "logged_steps": logged}
    log(f"synchronous log_batch: median {result['sync_ms_median']:.2f} ms a step (max {result['sync_ms_max']:.1f}); "
        f"StageLogger.metrics: median {result['stage_logger_ms_median']:.2f} ms (max "
        f"{result['stage_logger_ms_max']:.1f}); final flush {flush_ms:.1f} ms; {logged} of {a.steps} steps in MLflow")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "metrics_logging.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
