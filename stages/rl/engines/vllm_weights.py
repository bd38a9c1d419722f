"""New weights into vLLM's workers, which are other processes (vLLM's engine core, or its
tensor-parallel workers), without pickling a tensor: CUDA IPC.

The sender (the stage's engine rank) copies the tensors it is handed into one staging buffer on
its own GPU, `bucket_bytes` at a time (a larger tensor gets a buffer of its own size), and sends
each full buffer as a CUDA IPC handle (`torch.multiprocessing.reductions.reduce_tensor`) plus
its layout (name, dtype, shape, byte offset) through `collective_rpc`: every worker maps the
buffer (`rebuild_cuda_tensor`, the GPU found by its UUID: the worker numbers its GPUs
otherwise), copies it to its own GPU when it is another one (a tensor-parallel rank: one
peer-to-peer copy), and feeds views of it to the model's own `load_weights` (HF names; vLLM's
loader stacks q/k/v and gate/up and takes its tensor-parallel shard). Only the handle and the
layout are pickled: a few hundred bytes per bucket, whatever the model's size.

The worker function travels through `collective_rpc` by reference (cloudpickle), which vLLM
allows only with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set by the engine; the messages travel
between this process and the engine's own processes only). The bucket reaches the engine core
as msgpack (vllm/v1/serial_utils.py:214-235): tuples (torch.Size among them) arrive as lists,
torch classes and dtypes pickled; a tensor-parallel engine core pickles it on to its workers.
The worker's model is `worker.get_model()` (vllm/v1/worker/gpu_worker.py:929): the model itself
under either model runner (V2 is 0.26's default for dense models, vllm/config/vllm.py:550-621;
V1's get_model unwraps its CUDA-graph wrappers, vllm/v1/worker/gpu_model_runner.py:3288).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.multiprocessing import reductions

ALIGN = 256  # byte offset of every tensor in the staging buffer: any dtype's view is aligned


@dataclass
class SyncReport:
    """One sync's bytes, buckets and wall time, and where the time went (a sync costs a fixed
    ~60 ms at 0.5B and 1.5B alike on an H200, far above the copy bound; benchmarks/vllm_decode.py's
    `sync` runner measures it; these name the part): the
    sender's copies into the staging buffer (`copy_seconds`, with the synchronize before each
    bucket leaves), the `collective_rpc` round trips (`rpc_seconds`), and inside them the workers'
    mapping of the buffer (`map_seconds`) and vLLM's `load_weights` (`load_seconds`; the slowest
    worker of each bucket, summed over the buckets), then the engine's prefix-cache reset
    (`reset_seconds`, set by the engine)."""

    bytes: int = 0
    seconds: float = 0.0
    buckets: int = 0
    copy_seconds: float = 0.0
    rpc_seconds: float = 0.0
    map_seconds: float = 0.0
    load_seconds: float = 0.0
    reset_seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_of_uuid(uuid: str) -> int:
    """This process's index of the GPU with `uuid` (its CUDA_VISIBLE_DEVICES decides the numbering)."""
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise RuntimeError(f"vllm engine weight sync: GPU {uuid} (the engine rank's, which holds the staging "
                       f"buffer) is not visible to this vLLM worker; its CUDA_VISIBLE_DEVICES must include it")


def load_shared_bucket(worker: Any, bucket: dict) -> dict:
    """Runs on every vLLM worker (collective_rpc): the bucket's tensors into the worker's model.
    Returns the bytes loaded and the seconds of mapping the buffer and of `load_weights`.
    Synchronises before returning: the sender reuses its buffer then."""
    t0 = time.perf_counter()
    args = list(bucket["ipc"])
    args[6] = device_of_uuid(bucket["gpu"])  # the storage's device, in this process's numbering
    flat = reductions.rebuild_cuda_tensor(*args)
    here = torch.cuda.current_device()
    if flat.is_cuda and flat.device.index != here:  # a tensor-parallel rank on another GPU: one peer copy
        flat = flat.to(torch.device("cuda", here))
    weights = [(name, flat[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape))
               for name, dtype, shape, offset, nbytes in bucket["tensors"]]
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    worker.get_model().load_weights(weights)
    torch.cuda.synchronize()
    return {"bytes": sum(t[4] for t in bucket["tensors"]), "map_s": t1 - t0, "load_s": time.perf_counter() - t1}


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class IpcWeightSender:
    """`send(named_tensors)`: every tensor into the workers, in buckets (module docstring).
    `rpc(fn, kwargs)` is the engine's collective_rpc; `device` the sender's GPU."""

    def __init__(self, rpc: Callable[[Callable, dict], list], device: torch.device, bucket_bytes: int):
        self.rpc, self.device, self.bucket_bytes = rpc, device, int(bucket_bytes)
        self.gpu = device.index or 0  # the sender's GPU, named to the workers by its UUID
        self._buffer: torch.Tensor | None = None

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # the old one goes first: two large buffers need not coexist
            self._buffer = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=self.device)
        return self._buffer

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        t0 = time.perf_counter()
        report = SyncReport()
        layout: list[tuple[str, str, list[int], int, int]] = []
        used = 0
        copy_started = time.perf_counter()
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if layout and _aligned(used) + nbytes > self.bucket_bytes:
                self._flush(layout, report, copy_started)
                layout, used = [], 0
                copy_started = time.perf_counter()
            buf = self._staging(nbytes if not layout else 0)
            offset = _aligned(used)
            buf[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes))
            used = offset + nbytes
        if layout:
            self._flush(layout, report, copy_started)
        torch.cuda.ipc_collect()  # the IPC bookkeeping of buffers the workers have let go
        report.seconds = time.perf_counter() - t0
        return report

    def _flush(self, layout: list, report: SyncReport, copy_started: float) -> None:
        buf = self._staging(0)
        torch.cuda.synchronize(self.device)  # the copies have landed before another process reads them
        rpc_started = time.perf_counter()
        report.copy_seconds += rpc_started - copy_started
        _, ipc_args = reductions.reduce_tensor(buf)
        bucket = {"ipc": ipc_args, "gpu": gpu_uuid(self.gpu), "tensors": layout}
        loaded = self.rpc(load_shared_bucket, {"bucket": bucket})
        report.rpc_seconds += time.perf_counter() - rpc_started
        expected = sum(t[4] for t in layout)
        if any(w["bytes"] != expected for w in loaded):
            raise RuntimeError(f"vllm engine weight sync: the workers loaded {[w['bytes'] for w in loaded]} bytes "
                               f"of a {expected}-byte bucket")
        report.map_seconds += max(w["map_s"] for w in loaded)
        report.load_seconds += max(w["load_s"] for w in loaded)
        report.bytes += expected
        report.buckets += 1
