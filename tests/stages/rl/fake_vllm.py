"""A stand-in of the vLLM 0.26 API that stages/rl/engines/vllm_engine.py calls (its docstring
lists every call; a new call goes into both), and of the CUDA IPC calls of vllm_weights.py, so
CI drives the engine's own logic (streams to their end, the budget stop and abort, partial
outputs, continuation prompts, logprob extraction, finish reasons, seeds, bucketed weight
loading, sleep, GPU selection) without vLLM or a GPU.

The fake engine decodes on a stepping task of the engine's event loop, as vLLM's engine core
runs apart from its client: every step appends token (last * 7 + 3) % VOCAB to each live
request. Like vLLM, a request also stops at the model's own EOS unless its params say
ignore_eos, FINAL_ONLY streams yield once, and an aborted request's stream ends with an output
holding all it decoded (finish_reason "abort"). `collective_rpc` pickles its function and
arguments as vLLM's multi-process client does (its msgpack turns tuples into lists), and runs
the function on one worker per tensor-parallel rank. SamplingParams refuses what vLLM 0.26's
refuses (unknown fields, values out of range: vllm/sampling_params.py:205-347, 527-617).
"""
from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import pickle
import sys
import types
from pathlib import Path

import torch

from tests.stages.rl.tiny_model import EOS, VOCAB


def rule(seq: list[int], n: int) -> list[int]:
    """What the fake model decodes after `seq`, n tokens."""
    out: list[int] = []
    for _ in range(n):
        out.append(((list(seq) + out)[-1] * 7 + 3) % VOCAB)
    return out


# SamplingParams' public fields in vLLM 0.26 (vllm/sampling_params.py:213-347): a msgspec
# Struct, so any other keyword is a TypeError
SAMPLING_FIELDS = frozenset(
    "n presence_penalty frequency_penalty repetition_penalty temperature top_p top_k min_p seed stop "
    "stop_token_ids ignore_eos max_tokens min_tokens logprobs prompt_logprobs logprob_token_ids flat_logprobs "
    "detokenize skip_special_tokens spaces_between_special_tokens include_stop_str_in_output output_kind "
    "skip_clone output_text_buffer_length structured_outputs logit_bias allowed_token_ids extra_args "
    "routed_experts_prompt_start bad_words skip_reading_prefix_cache thinking_token_budget "
    "repetition_detection".split())


class FakeParams:
    def __init__(self, **kw):
        unknown = sorted(set(kw) - SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"Unexpected keyword argument(s) {unknown}")
        self.__dict__.update(kw)
        # what vLLM's SamplingParams._verify_args refuses (vllm/sampling_params.py:527-617)
        checks = {"temperature must be in [0, 2]": 0.0 <= kw.get("temperature", 1.0) <= 2.0,
                  "top_p must be in (0, 1]": 0.0 < kw.get("top_p", 1.0) <= 1.0,
                  "top_k must be 0 (disable), or at least 1": kw.get("top_k", 0) >= -1,
                  "max_tokens must be at least 1": kw.get("max_tokens", 16) is None or kw.get("max_tokens", 16) >= 1,
                  "logprobs must be non-negative or -1": kw.get("logprobs") is None or kw["logprobs"] >= -1,
                  "stop strings are only supported when detokenize is True": not kw.get("stop")
                  or kw.get("detokenize", True)}
        for what, ok in checks.items():
            if not ok:
                raise ValueError(f"{what}: {kw}")


VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vllm/config/model.py ModelConfig.dtype


class FakeEngineArgs:
    def __init__(self, **kw):
        if kw.get("dtype", "auto") not in VLLM_DTYPES:  # vLLM's own validation, at engine start
            raise ValueError(f"dtype: Input should be {' or '.join(map(repr, VLLM_DTYPES))}: {kw['dtype']!r}")
        self.kw = kw


class FakeModel:
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()


class FakeWorker:
    """A vLLM worker as collective_rpc hands it to a function: `get_model()` is the model
    (vllm/v1/worker/gpu_worker.py:929; `model_runner.model` may be a CUDA-graph wrapper)."""

    def __init__(self):
        self._model = FakeModel()

    def get_model(self) -> FakeModel:
        return self._model


def as_msgpack(obj):
    """What vLLM's msgpack leaves of `obj`: tuples (torch.Size too) become lists; other
    objects it cannot encode travel pickled, as they are (vllm/v1/serial_utils.py:190-235)."""
    if isinstance(obj, (list, tuple)):
        return [as_msgpack(x) for x in obj]
    if isinstance(obj, dict):
        return {k: as_msgpack(v) for k, v in obj.items()}
    return obj


class FakeAsyncLLM:
    def __init__(self, args: FakeEngineArgs):
        self.kw = args.kw
        self.env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_ALLOW_INSECURE_SERIALIZATION",
                                                    "LOCAL_RANK", "VLLM_WORKER_MULTIPROC_METHOD")}
        self.live: dict[str, dict] = {}
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, FakeParams] = {}
        self.aborted: list[str] = []
        self.lose: set[str] = set()  # request uids the scheduler drops without a word
        self.workers = [FakeWorker() for _ in range(int(self.kw.get("tensor_parallel_size", 1)))]
        self.rpc_bytes: list[int] = []  # the pickled size of each collective_rpc
        self.resets = 0
        self.slept: list = []
        self.shut = False
        self.output_processor = types.SimpleNamespace(has_unfinished_requests=lambda: bool(self.live))
        self._stepper: asyncio.Task | None = None

    @classmethod
    def from_engine_args(cls, args: FakeEngineArgs) -> "FakeAsyncLLM":
        asyncio.get_running_loop()  # AsyncLLM's output handler needs the loop it is built on
        return cls(args)

    # -- decoding ----------------------------------------------------------------------------
    async def generate(self, prompt: dict, params: FakeParams, request_id: str):
        assert params.output_kind == "FINAL_ONLY"  # one output per request, at its end
        ids = list(prompt["prompt_token_ids"])
        self.prompts[request_id], self.params[request_id] = list(ids), params
        state = {"ids": ids, "out": [], "p": params, "reason": None, "done": asyncio.Event()}
        self.live[request_id] = state
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.ensure_future(self._run())
        try:
            await state["done"].wait()
        except asyncio.CancelledError:
            self.live.pop(request_id, None)
            raise
        values = [-0.1 * (k + 1) for k in range(len(state["out"]))]
        if getattr(params, "flat_logprobs", False):  # vllm/logprobs.py FlatLogprobs, logprobs=0: one entry a position
            n = len(values)
            lps = types.SimpleNamespace(start_indices=list(range(n)), end_indices=list(range(1, n + 1)),
                                        token_ids=list(state["out"]), logprobs=values, ranks=[1] * n,
                                        decoded_tokens=[None] * n)
        else:
            lps = [{t: types.SimpleNamespace(logprob=v)} for t, v in zip(state["out"], values)]
        comp = types.SimpleNamespace(token_ids=list(state["out"]), logprobs=lps, finish_reason=state["reason"])
        yield types.SimpleNamespace(request_id=request_id, outputs=[comp], finished=True)

    async def _run(self) -> None:
        while self.live:
            for rid in [r for r in self.live if r.split("-", 2)[2] in self.lose]:
                del self.live[rid]
            for rid, r in list(self.live.items()):
                tok = (r["ids"][-1] * 7 + 3) % VOCAB
                r["ids"].append(tok)
                r["out"].append(tok)
                model_eos = tok == EOS and not getattr(r["p"], "ignore_eos", False)
                reason = ("stop" if tok in r["p"].stop_token_ids or model_eos else
                          "length" if len(r["out"]) >= r["p"].max_tokens else None)
                if reason:
                    self._end(rid, reason)
            await asyncio.sleep(0)

    def _end(self, rid: str, reason: str) -> None:
        state = self.live.pop(rid)
        state["reason"] = reason
        state["done"].set()

    async def abort(self, request_id, internal: bool = False) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.aborted.append(rid)
            if rid in self.live:  # vLLM ignores ids it does not hold
                self._end(rid, "abort")

    # -- the rest of the engine's API ----------------------------------------------------------
    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        payload = pickle.dumps((method, args, kwargs or {}))  # by reference: an importable function
        self.rpc_bytes.append(len(payload))
        method, args, kwargs = as_msgpack(pickle.loads(payload))
        return [method(w, *args, **kwargs) for w in self.workers]

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False):
        self.resets += 1
        return True

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.slept.append(level)

    async def wake_up(self, tags=None) -> None:
        self.slept.append("awake")

    def shutdown(self, timeout=None) -> None:
        self.shut = True


class FakeIpc:
    """CUDA IPC without CUDA: `reduce_tensor` registers the buffer under a key (what travels is
    the key, as a real handle is a few bytes), `rebuild_cuda_tensor` finds it again and checks
    that the storage's device was set from the sender's GPU UUID."""

    def __init__(self, sender_gpu: int):
        self.shared: dict[int, torch.Tensor] = {}
        self.keys = itertools.count()
        self.sender_gpu = sender_gpu

    def reduce_tensor(self, tensor: torch.Tensor):
        key = next(self.keys)
        self.shared[key] = tensor
        args = [None] * 15
        args[6], args[7] = self.sender_gpu, key
        return None, tuple(args)

    def rebuild_cuda_tensor(self, *args):
        assert args[6] == self.sender_gpu, f"storage device {args[6]} is not the sender's GPU"
        return self.shared[args[7]]


def install(monkeypatch, version: str = "0.26.0", gpus: int = 4, sender_gpu: int = 0):
    """The fake `vllm` package in sys.modules, CUDA calls the engine makes answered on CPU, and
    a fresh copy of vllm_engine.py loaded against them. Returns (engine module, fake vllm, ipc)."""
    from torch.multiprocessing import reductions

    import stages.rl.engines.protocol as base
    import stages.rl.engines.vllm_weights as weights

    fake = types.ModuleType("vllm")
    fake.__version__ = version
    fake.AsyncLLMEngine, fake.AsyncEngineArgs = FakeAsyncLLM, FakeEngineArgs
    fake.SamplingParams, fake.TokensPrompt = FakeParams, dict
    fake.sampling_params = types.ModuleType("vllm.sampling_params")
    fake.sampling_params.RequestOutputKind = types.SimpleNamespace(FINAL_ONLY="FINAL_ONLY", DELTA="DELTA")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake.sampling_params)
    monkeypatch.setattr(base, "ENGINES", {})
    monkeypatch.setattr(base, "UNAVAILABLE", {})
    # what the engine puts in this process's environment goes when the test ends
    for var in ("VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.delenv(var, raising=False)
    for name, value in {"is_available": lambda: True, "synchronize": lambda *a, **k: None,
                        "device_count": lambda: gpus, "current_device": lambda: 0,
                        "ipc_collect": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(weights, "gpu_uuid", lambda index: f"GPU-uuid-{index}")
    ipc = FakeIpc(sender_gpu)
    monkeypatch.setattr(reductions, "reduce_tensor", ipc.reduce_tensor)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", ipc.rebuild_cuda_tensor)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = Path(base.__file__).with_name("vllm_engine.py")
    spec = importlib.util.spec_from_file_location("stages.rl.engines._vllm_fake", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "STALL_CHECK_S", 0.05)
    return mod, fake, ipc


def open_engine(mod, model_dir, **kw):
    """An engine of the loaded module whose weight sync stages its buckets in CPU memory."""
    eng = mod.make_vllm_engine(str(model_dir), **{"device": "cuda", **kw})
    eng._weights.device = torch.device("cpu")
    return eng
