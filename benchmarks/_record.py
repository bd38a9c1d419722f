"""What the GPU benchmark scripts share: the environment they run under, progress lines with
the time of day (the device's output comes back as one log, read afterwards), one JSON file of
results under --out rewritten whole after every measurement (a run cut short, or killed at its
time limit, keeps what it finished), and the machine the numbers came from.

    from benchmarks._record import SAFE_ENV, ResultFile, device_name, log, versions
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# every process of a GPU benchmark and its children: NVLink multicast stays off (a shared host's
# GPUs can hang), output unbuffered (it is read as it comes), no tokenizer threads after a fork
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class ResultFile:
    """A JSON object at `path`, written again after every `put`."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resume(cls, path: Path) -> ResultFile:
        """The file as an earlier run (or an earlier part of this one) left it, added to."""
        return cls(path, json.loads(path.read_text()) if path.exists() else {})

    def put(self, *keys: str, result: Any) -> None:
        """`result` under the nested `keys` (the inner objects made as needed), then written."""
        node = self.data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = result
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2))


def device_name(cuda: bool) -> str:
    """The GPU's name (the first visible one), or "cpu"."""
    import torch

    return torch.cuda.get_device_name(0) if cuda else "cpu"


def versions() -> dict[str, str]:
    """The versions a timing depends on, and when it was taken."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
