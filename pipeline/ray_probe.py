"""The GPUs of a Ray cluster, for the `auto` speed settings of its `launcher: ray` stages:

    python -m pipeline.ray_probe --address ADDRESS --timeout 60

connects to the cluster as a driver, runs stages/common/hardware.py's `detect` (the probe the
local launchers use) as one Ray task that asks for one GPU, and prints one JSON line of
`HardwareFacts` fields: the GPU the task got, its node's GPU count, and a note saying where the
facts came from; or `device: unknown` with a note saying exactly why there are none (no cluster
answers, the cluster has no GPU or none free, the task saw no CUDA device, it timed out).
pipeline/speed.py runs this in a child process under a time limit, as it runs the local probe:
planning never hangs on a cluster, and the pipeline's own process never becomes a Ray driver.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline.ray_launch import LaunchError, check_reachable
from stages.common.hardware import detect

TASK_TIMEOUT_S = 60.0  # a worker's start and its torch import on a cold node take seconds, not minutes


def unknown(note: str) -> dict[str, Any]:
    return {"device": "unknown", "note": note}


def gpu_facts() -> dict[str, Any]:
    """Runs on the cluster, in a task holding one GPU: that machine's facts and its Ray node."""
    import ray

    return {**detect(), "node_id": ray.get_runtime_context().get_node_id()}


def gpu_nodes(nodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The live nodes with GPUs: node id -> its GPU count and Ray's accelerator label (e.g. H100)."""
    out = {}
    for n in nodes:
        res = n.get("Resources") or {}
        if n.get("Alive") and res.get("GPU"):
            kinds = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            out[n["NodeID"]] = {"gpus": int(res["GPU"]), "type": kinds[0] if kinds else None}
    return out


def cluster_note(address: str, gpu_name: str, nodes: dict[str, dict[str, Any]]) -> str:
    """Where the facts came from: `Ray cluster ADDRESS: NAME x N GPUs on M node(s)`."""
    total = sum(n["gpus"] for n in nodes.values())
    note = f"Ray cluster {address}: {gpu_name} x {total} GPUs on {len(nodes)} node(s) (a one-GPU task probed one)"
    kinds = sorted({n["type"] for n in nodes.values() if n["type"]})
    if len(kinds) > 1:
        note += f"; the cluster mixes GPU types ({', '.join(kinds)}): the settings fit the probed one"
    return note


def probe_cluster(address: str, timeout_s: float) -> dict[str, Any]:
    """The facts of a GPU of the cluster at `address` (connected to here, disconnected after)."""
    import ray

    nodes = gpu_nodes(ray.nodes())
    if not nodes:
        return unknown(f"the Ray cluster at {address!r} has no GPU now (its resources: "
                       f"{_resources(ray.cluster_resources())}); an autoscaling cluster adds GPU nodes only "
                       "when a stage asks for them")
    total, free = sum(n["gpus"] for n in nodes.values()), ray.available_resources().get("GPU", 0)
    if free < 1:
        return unknown(f"all {total} GPUs of the Ray cluster at {address!r} are in use: not probed")
    ref = ray.remote(num_gpus=1, num_cpus=0, max_retries=0)(gpu_facts).remote()
    try:
        facts = ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        return unknown(f"the one-GPU probe task on the Ray cluster at {address!r} did not finish within "
                       f"{timeout_s:g}s ({total} GPUs, {free:g} free when it was submitted)")
    except ray.exceptions.RayError as e:
        return unknown(f"the one-GPU probe task on the Ray cluster at {address!r} failed: "
                       f"{type(e).__name__}: {_first_line(e)}")
    node = nodes.get(facts.pop("node_id"), {"gpus": 1})
    if facts["device"] != "cuda":
        return unknown(f"a one-GPU task on the Ray cluster at {address!r} saw no CUDA device "
                       f"({facts.get('note', '')}): the cluster declares GPUs that torch cannot use there")
    return {**facts, "gpus": node["gpus"], "note": cluster_note(address, facts["gpu_name"], nodes)}


def probe(address: str, timeout_s: float) -> dict[str, Any]:
    """Connect, probe, disconnect; every failure is a note, never an exception."""
    try:  # Ray's own client waits minutes for a GCS that is not there: $RAY_ADDRESS's, a crashed head's recorded one
        check_reachable(address)
    except LaunchError as e:
        return unknown(str(e))
    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=False)
    except Exception as e:  # noqa: BLE001 - no cluster, a ray:// address without ray[client]...: said in the note
        return unknown(f"cannot connect to the Ray cluster at {address!r} (ray.address): "
                       f"{type(e).__name__}: {_first_line(e)}")
    try:
        return probe_cluster(address, timeout_s)
    finally:
        ray.shutdown()


def _resources(res: dict[str, float]) -> str:
    shown = {k: v for k, v in res.items() if k in ("CPU", "GPU") or k.startswith("accelerator_type:")}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "none"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="auto")
    parser.add_argument("--timeout", type=float, default=TASK_TIMEOUT_S)
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.address, args.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
