"""The hardware facts of this machine for the speed settings' `auto` (stages/common/speed_defaults.py):
GPU name, compute capability and memory (torch.cuda.get_device_properties), GPU and CPU counts,
whether flash-attn imports. `python -m stages.common.hardware` prints them as JSON: the pipeline
runs it in a child process, so that its own process never initialises CUDA (pipeline/speed.py)."""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

GIB = 1024 ** 3


def detect() -> dict[str, Any]:
    """This machine's facts as `HardwareFacts` fields (GPU 0 stands for the node's GPUs)."""
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not torch.cuda.is_available():
        return {"device": "cpu", "cpus": cpus, "note": "no CUDA device visible to torch"}
    props = torch.cuda.get_device_properties(0)
    return {"device": "cuda", "gpu_name": props.name, "capability": [props.major, props.minor],
            "memory_gib": round(props.total_memory / GIB, 2), "gpus": torch.cuda.device_count(), "cpus": cpus,
            "flash_attn": importlib.util.find_spec("flash_attn") is not None,
            "note": "torch.cuda.get_device_properties(0) on the launching machine"}


if __name__ == "__main__":
    print(json.dumps(detect()))
