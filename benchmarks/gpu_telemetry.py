"""What the GPUs did while a benchmark job ran, and which host they were on: the facts that tell a
slow loan from slow code. Issue 36 saw the same 4-GPU SFT run 18% slower on one loan than on another,
and round 19 saw DeepSpeed's launcher 7-10% behind Ray's on the same GPUs; neither run kept a
clock, a power cap or a topology to explain it.

    from benchmarks.gpu_telemetry import GpuSampler, host_facts

`host_facts()` is one snapshot of the machine: `nvidia-smi topo -m` (NVLink / PCIe / NUMA), each
GPU's bus id, power limit, maximum clocks, persistence and ECC, other processes on the GPUs, the
CPU and the load. `GpuSampler` runs `nvidia-smi --query-gpu ... -lms` over a job's GPUs while it
runs (one CSV line per GPU per interval) and sums it up per GPU: SM clock (median, lowest),
power, temperature, utilisation, and the share of samples in which the driver reported a
slowdown (power cap, thermal, hardware slowdown or power brake). Where nvidia-smi is missing
(CPU machines) both say so and nothing else changes.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

FIELDS = ("index", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "utilization.gpu",
          "memory.used", "clocks_event_reasons.active")
# drivers before 535 name the last field so; newer ones accept both or only the first
OLD_REASONS_FIELD = "clocks_throttle_reasons.active"
# the bits of the reasons mask that mean the GPU ran slower than it could (idle, an
# application clock setting and display clocks are not slowdowns)
SLOWDOWN_BITS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                 0x80: "hw_power_brake"}
HOST_QUERIES = {
    "gpus": ["nvidia-smi", "--query-gpu=index,name,pci.bus_id,driver_version,power.limit,clocks.max.sm,"
             "clocks.max.mem,persistence_mode,ecc.mode.current", "--format=csv"],
    "topology": ["nvidia-smi", "topo", "-m"],
    "other_gpu_processes": ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory", "--format=csv"],
    "cpu": ["lscpu"],
}


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    return out.stdout if out.returncode == 0 else f"unavailable: exit {out.returncode}: {out.stderr.strip()[:300]}"


def host_facts() -> dict[str, str]:
    """One snapshot of the host: each query's text, or `unavailable: why`."""
    facts = {name: _run(cmd) for name, cmd in HOST_QUERIES.items()}
    facts["loadavg"] = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "unavailable"
    return facts


def query_fields() -> tuple[str, ...] | str:
    """The fields this driver answers (the reasons field under its new or old name), or why none."""
    if shutil.which("nvidia-smi") is None:
        return "unavailable: nvidia-smi not found"
    why = ""
    for fields in (FIELDS, FIELDS[:-1] + (OLD_REASONS_FIELD,)):
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return fields
        why = f"unavailable: nvidia-smi exit {out.returncode}: {(out.stderr or out.stdout).strip()[:300]}"
    return why


class GpuSampler:
    """`nvidia-smi` sampling GPUs `devices` every `interval_ms` into `csv_path` until `stop()`;
    `fields`: what `query_fields()` found (asked once per machine, not per job), or why none."""

    def __init__(self, devices: list[int], csv_path: Path, fields: tuple[str, ...] | str, interval_ms: int = 1000):
        self.devices, self.csv_path, self.fields = devices, csv_path, fields
        self.proc: subprocess.Popen | None = None
        if isinstance(self.fields, str):
            return
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        self.err_path = csv_path.with_suffix(".err")
        with open(csv_path, "w") as sink, open(self.err_path, "w") as err:
            sink.write(",".join(self.fields) + "\n")
            sink.flush()
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits",
                 f"--loop-ms={interval_ms}", f"--id={','.join(map(str, devices))}"],
                stdout=sink, stderr=err, start_new_session=True)

    def stop(self) -> dict[str, Any]:
        """End the sampling; the per-GPU summary (or why there is none)."""
        if self.proc is None:
            return {"unavailable": self.fields}
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        summary = summarize(self.csv_path)
        if not summary:  # the loop refused what the one-shot query took: say what it said
            return {"unavailable": f"no samples; nvidia-smi said: {self.err_path.read_text().strip()[:300]}"}
        return summary


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def _values(samples: list[dict[str, str]], field: str) -> list[float]:
    return [v for s in samples if (v := _number(s[field])) is not None]


def summarize(csv_path: Path) -> dict[str, Any]:
    """Per GPU index: samples, SM clock median / lowest (MHz), power median (W), hottest (C),
    utilisation median (%), and the share of samples with a slowdown reason, with the reasons seen."""
    lines = csv_path.read_text().splitlines()
    header, rows = lines[0].split(","), [[c.strip() for c in line.split(",")] for line in lines[1:] if line.strip()]
    per_gpu: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        if len(row) == len(header):
            per_gpu.setdefault(row[0], []).append(dict(zip(header, row)))
    summary: dict[str, Any] = {}
    for gpu, samples in sorted(per_gpu.items()):
        masks = [int(s[header[-1]], 16) for s in samples if s[header[-1]].startswith("0x")]
        slowed = [m for m in masks if any(m & bit for bit in SLOWDOWN_BITS)]
        sm, power, temp, util = (_values(samples, f) for f in ("clocks.sm", "power.draw", "temperature.gpu",
                                                                 "utilization.gpu"))
        summary[gpu] = {
            "samples": len(samples),
            "sm_clock_mhz_median": statistics.median(sm) if sm else None,
            "sm_clock_mhz_min": min(sm) if sm else None,
            "power_w_median": statistics.median(power) if power else None,
            "temperature_c_max": max(temp) if temp else None,
            "utilization_pct_median": statistics.median(util) if util else None,
            "slowdown_fraction": len(slowed) / len(masks) if masks else None,
            "slowdown_reasons": sorted({name for m in slowed for bit, name in SLOWDOWN_BITS.items() if m & bit}),
        }
    return summary
