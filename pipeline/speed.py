"""The pipeline's side of the training stages' `auto` speed settings: the facts of the machine
that will run a stage (its GPUs, probed in a child process that imports torch; CPU ranks need
no probe), of its model (its config.json in the store) and its ranks, handed to
`stages.common.speed_defaults.resolve_speed`, which decides. `execute` writes the decided
values into the job's config and the manifest (`resolved_speed`); `plan` prints them.

Which machine: the deepspeed / torchrun / local launchers of one node start the ranks here, so
this machine's GPUs are the stage's. A `launcher: ray` stage runs on the cluster at its
`ray.address`: a child process connects there and probes one of its GPUs with a one-GPU Ray
task (pipeline/ray_probe.py). A deepspeed / torchrun stage over several nodes runs on the
hostfile's machines, which the pipeline reaches only through the launcher's own ssh: its facts
are `unknown`, as are a cluster's that cannot be reached, has no free GPU or whose probe times
out; the settings then resolve to what they were before `auto` existed (precision and attention
decided by the job on its device, as before), with a note saying why."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from data_curation.urls import filesystem, join
from stages.common.contract import Launcher, RaySettings, Resources
from stages.common.speed_defaults import ORDER, HardwareFacts, ModelFacts, Resolution, resolve_speed
from stages.registry import StageKind

PROBE_TIMEOUT_S = 120.0  # the whole child process: its imports; a Ray probe's connection and task (60 s of it)
ROOT = Path(__file__).resolve().parent.parent


def hardware_for(resources: Resources, launcher: Launcher, ray: RaySettings | None = None) -> HardwareFacts:
    """The facts of the machine whose ranks run a stage of `resources` under `launcher` (`ray`:
    the stage's cluster settings)."""
    if not resources.gpus_per_node:
        return HardwareFacts("cpu", cpus=resources.cpu_ranks, note="resources.gpus_per_node: 0 (CPU ranks)")
    if launcher == "ray":
        return ray_gpus((ray or RaySettings()).address)
    if resources.nodes > 1:
        return HardwareFacts("unknown", note=f"{resources.nodes} nodes: their GPUs are not probed before launch "
                                             "(the launcher reaches the hostfile's machines only at launch)")
    return local_gpus()


@lru_cache(maxsize=1)
def local_gpus() -> HardwareFacts:
    """This machine's GPUs, once per process (a child process imports torch and asks CUDA)."""
    if not glob.glob("/dev/nvidia[0-9]*") and not shutil.which("nvidia-smi"):
        return HardwareFacts("unknown", note="no GPU visible on this machine")
    return _probe(["-m", "stages.common.hardware"], "the GPU probe")


@lru_cache(maxsize=None)
def ray_gpus(address: str) -> HardwareFacts:
    """The GPUs of the Ray cluster at `address`, once per address and process: a child process
    connects and runs the probe as a one-GPU Ray task there (pipeline/ray_probe.py)."""
    if importlib.util.find_spec("ray") is None:
        return HardwareFacts("unknown", note="launcher ray: ray is not installed here (pip install -e '.[ray]')")
    return _probe(["-m", "pipeline.ray_probe", "--address", address], f"the Ray cluster's GPU probe ({address})")


def _probe(args: list[str], what: str) -> HardwareFacts:
    """The facts a probe module prints as its last line of JSON, run as a child process of this
    checkout (cwd too: a Ray driver's workers import from its working directory)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              env=env, cwd=ROOT, check=True)
        facts = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return HardwareFacts("unknown", note=f"{what} did not answer within {PROBE_TIMEOUT_S:g}s (killed)")
    except subprocess.CalledProcessError as e:
        return HardwareFacts("unknown", note=f"{what} failed: {(e.stderr or str(e)).strip()[-200:]}")
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        return HardwareFacts("unknown", note=f"{what} failed: {str(e)[:200]}")
    if facts["device"] != "cuda":
        return HardwareFacts("unknown", note=facts.get("note", "no CUDA device"))
    facts["capability"] = tuple(facts["capability"])
    return HardwareFacts(**facts)


def model_facts(model_url: Any, storage_options: dict[str, Any]) -> ModelFacts | None:
    """The model's size from its config.json; None where it cannot be read yet (an upstream
    stage that has not run) or has no size fields the estimate knows."""
    if not isinstance(model_url, str) or model_url.startswith(("hf://", "http://", "https://")):
        return None  # nothing is downloaded to plan a stage (the job fetches its model itself)
    try:
        fs, path = filesystem(join(model_url, "config.json"), storage_options)
        with fs.open(path, "r") as f:
            return ModelFacts.from_config(json.load(f))
    except Exception:  # noqa: BLE001 - not readable now: the memory estimate is skipped, said in the notes
        return None


def training_ranks(config: dict[str, Any], resources: Resources) -> int:
    """The ranks that train: an RL stage's split placement gives `rollout.gpus` ranks to its engines."""
    engines = (config.get("rollout") or {}).get("gpus") or 0
    return max(resources.world_size - engines, 1)


def resolve_stage_speed(kind: StageKind, config: dict[str, Any], resources: Resources, launcher: Launcher,
                        storage_options: dict[str, Any], ray: RaySettings | None = None) -> Resolution | None:
    """The decided `auto` speed settings of a stage (its config with references resolved to
    URLs); None for a kind without speed settings."""
    if kind.speed is None:
        return None
    if any(config.get(setting) == "auto" for setting in ORDER):
        hw = hardware_for(resources, launcher, ray)
    else:  # nothing to decide: no probe (a Ray stage's cluster is not contacted)
        hw = HardwareFacts("unknown", note="every speed setting is written in the config: nothing probed")
    model = model_facts(config.get("model"), storage_options) if hw.device == "cuda" else None
    return resolve_speed(kind.speed, config, hw, model, training_ranks(config, resources))
