"""The `vllm` rollout engine (GPU): vLLM's own multi-process engine (the engine core, its
scheduler and model runner in processes of their own, as `vllm.LLM` runs them), per-token
logprobs, weights updated in place after every trainer update over CUDA IPC, tensor
parallelism, unfinished rollouts continued by resubmission.

Written against vLLM 0.26 (the release that pins the GPU machines' torch 2.11); CI has neither
vLLM nor a GPU and drives this module against a stand-in of the same API
(tests/stages/rl/fake_vllm.py: every call below is in its contract). The calls it makes:
- `AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=..., dtype=..., seed=...,
  max_model_len=..., max_num_seqs=..., gpu_memory_utilization=..., enable_prefix_caching=...,
  tensor_parallel_size=..., logprobs_mode="processed_logprobs", disable_log_stats=True))`,
  built and driven on an asyncio loop of its own thread (vllm_loop.py). AsyncLLM is vLLM's
  engine with the engine core in another process (V1 multiprocessing, async scheduling):
  `LLM.generate` runs the same core. The returned logprob is that of the temperature-scaled
  distribution, like the torch engine's; "processed" also applies top-k / top-p
  renormalisation, so `reports_untruncated_logprobs` is False and the recipe guard refuses
  top_p < 1 / top_k > 0 with IcePop or TIS on this engine.
- `engine.generate(TokensPrompt(prompt_token_ids=...), params, request_id)`: an async stream
  per request; with FINAL_ONLY outputs it yields once, when the request ends (no per-step
  output objects: what `LLM.generate` asks for too; vllm/v1/engine/output_processor.py:285).
  (0.26 logs once that raw prompts are deprecated in favour of its renderer's output, and
  takes them: vllm/v1/engine/input_processor.py:282.) The finished-token budget (C3PO++): once
  the finished rollouts' lengths reach it, `engine.abort([ids])` (our request ids: vLLM maps
  them to its internal ones) ends the rest, and each of their streams yields a final output
  (finish_reason "abort") holding every token and logprob it had (output_processor.py:459-520,
  399-402): partial rollouts keep what they decoded. `engine.output_processor
  .has_unfinished_requests()`: a request vLLM no longer holds is an error, not a wait for ever.
- `SamplingParams(n=1, temperature, top_p, top_k (-1 = off), seed, max_tokens, logprobs=0,
  stop_token_ids, ignore_eos=True, detokenize=False, output_kind=FINAL_ONLY)`: `logprobs=0`
  returns the sampled token's logprob only; finish_reason "stop" (EOS / stop token) -> "eos",
  "length" -> "length", "abort" -> unfinished. vLLM refuses a temperature above 2
  (vllm/sampling_params.py:552): generate says so before it submits anything.
- Seeds: each request carries a seed derived from (seed, uid, offset), so a rollout's tokens do
  not depend on the batch it ran in (as on the torch engine). vLLM 0.26 samples seeded requests
  on its native path, one `exponential_` kernel per seeded request per decode step
  (vllm/v1/sample/ops/topk_topp_sampler.py:195-202); that is not what makes its step slow here:
  `LLM.generate` without seeds takes the same ~12.5 ms a step at batch 256 on an H200
  (benchmarks/vllm_decode.py's `native_unseeded` runner). `rollout.options {request_seeds:
  false}` submits requests unseeded (vLLM's batched sampler, the engine's own seed only, which
  the RL stage makes differ between engines: rollouts.py), and a resumed run no longer replays
  the same tokens (its engines restart their noise stream).
- Log-probs make vLLM's step slow here: 12.5 ms at 0.5B with `logprobs=0`, 6.7 without (H200),
  a dict and a `Logprob` per token. `rollout.options {flat_logprobs: true}`: vLLM's FlatLogprobs
  (flat lists; `_sampled_logprobs` reads both); not measured on a GPU yet, hence off by default.
- Weights: `engine.collective_rpc(fn, kwargs=...)` runs `fn(worker, ...)` on every worker: CUDA
  IPC handles of a staging buffer, bucketed (`sync_bucket_mb`), loaded by the model's own
  `load_weights` (vllm_weights.py); then `engine.reset_prefix_cache()`, so a continued
  rollout's prefix is re-encoded with the new weights instead of reusing KV of the old ones.
  `last_sync` holds the latest sync's bytes, seconds and GB/s, and where its time went.
- Sleep (colocated placement, while the trainer steps): `engine.sleep(level)` /
  `engine.wake_up()` (V1's sleep mode, which needs `enable_sleep_mode=True`: rollout.options).
  Level 1 drops the KV cache and offloads the weights to CPU memory; level 2 (`weights`)
  drops both, and the weight sync after `wake()` refills them. Sleeping pauses vLLM's
  scheduler; `wake_up()` without tags restores all and resumes it (vllm/v1/engine/core.py:860-914).
- `engine.shutdown()` (`close()`): the engine's processes end and its GPU memory is returned.

GPUs: the engine runs on `tensor_parallel_size` GPUs starting at `device` (cuda:N = this
process's N-th visible GPU): the engine's processes are started with CUDA_VISIBLE_DEVICES set
to those GPUs (and without the launcher's RANK / LOCAL_RANK / ...), so one stage rank (an engine
rank of the placement, stages/rl/placement.py) owns a tensor-parallel group of GPUs.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import time
import weakref
from typing import Iterable

import torch

from stages.common.hf_io import eos_token_ids_of
from stages.rl.settings import WEIGHT_DTYPE_NAMES

from .protocol import IGNORED_PREFIXES, UNAVAILABLE, RolloutRequest, RolloutUpdate, SamplingParams, SyncTiming, register_engine
from .vllm_loop import LoopThread
from .vllm_weights import IpcWeightSender, SyncReport

log = logging.getLogger(__name__)

MIN_VLLM = (0, 26)  # the API this module is written against (module docstring)
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more (vllm/sampling_params.py:552)
STALL_CHECK_S = 5.0  # how often a generate that waits checks that vLLM still holds its requests


def _installed_vllm() -> tuple[str | None, str | None]:
    """(vLLM's version, None), or (None, why it is not there), without importing it: importing
    vLLM takes seconds and probes CUDA, and every process that imports the engine registry
    would pay it (the stage entries, and with them the verifier workers, which multiprocessing
    starts by importing the stage's main module: on an H100 that outlived every row's timeout)."""
    loaded = sys.modules.get("vllm")
    if loaded is not None:
        return getattr(loaded, "__version__", "0"), None
    try:
        if importlib.util.find_spec("vllm") is None:
            return None, "No module named 'vllm'"
        return importlib.metadata.version("vllm"), None
    except Exception as e:  # noqa: BLE001 - a broken install's metadata
        return None, f"{type(e).__name__}: {e}"


def _import_vllm():
    """vLLM's API this module calls, imported when the first engine is built."""
    try:
        from vllm import AsyncEngineArgs, AsyncLLMEngine, TokensPrompt
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind
    except Exception as e:  # ImportError, or a broken CUDA/vLLM install raising anything else
        raise RuntimeError(f"vllm engine: vllm is installed but does not import: {type(e).__name__}: {e}") from e
    return AsyncLLMEngine, AsyncEngineArgs, VllmSamplingParams, TokensPrompt, RequestOutputKind


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _strip(name: str) -> str:
    while name.startswith(IGNORED_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def _sampled_logprobs(uid: str, tokens: list[int], logprobs) -> list[float]:
    """The sampled tokens' log-probs (`logprobs=0`): vLLM's list of {token: Logprob} per position,
    or its FlatLogprobs, each position's entries from `start_indices[i]`, the sampled one first."""
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:
        return [float(d[t].logprob) for t, d in zip(tokens, logprobs or [])]
    ids, values = logprobs.token_ids, logprobs.logprobs
    if any(ids[s] != t for s, t in zip(starts, tokens)):
        raise RuntimeError(f"vllm engine: request {uid!r}: the flat log-probs are not of the sampled tokens")
    return [float(values[s]) for s in starts]


def _request_seed(seed: int, uid: str, offset: int) -> int:
    h = hashlib.blake2b(f"{seed}:{uid}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF


def engine_gpus(device: str, tensor_parallel_size: int) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of an engine on `tensor_parallel_size` GPUs from
    `device` (cuda or cuda:N, N counted in this process's visible GPUs)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"vllm engine: device must be 'cuda' or 'cuda:N', got {device!r}")
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = ([d.strip() for d in env.split(",") if d.strip()] if env is not None
               else [str(i) for i in range(torch.cuda.device_count())])
    first = dev.index or 0
    if tensor_parallel_size < 1 or first + tensor_parallel_size > len(visible):
        raise ValueError(f"vllm engine: device {device!r} with tensor_parallel_size {tensor_parallel_size} "
                         f"needs visible GPUs {first}..{first + tensor_parallel_size - 1}, and this process "
                         f"sees {len(visible)} ({'CUDA_VISIBLE_DEVICES=' + env if env is not None else 'all'})")
    return visible[first:first + tensor_parallel_size]


# the stage launcher's torch.distributed variables: vLLM's processes form process groups of their
# own, and some of its code reads LOCAL_RANK when set (vllm/distributed/parallel_state.py)
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def _engine_environment(gpus: list[str]):
    """The environment of the processes the engine starts meanwhile: CUDA_VISIBLE_DEVICES = the
    engine's GPUs (this process's CUDA is already up and keeps its numbering), none of the
    launcher's rank variables."""
    before = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", *LAUNCHER_ENV)}
    _set_environ({"CUDA_VISIBLE_DEVICES": ",".join(gpus), **{k: None for k in LAUNCHER_ENV}})
    try:
        yield
    finally:
        _set_environ(before)


def _set_environ(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _multicast_off_defaults(engine_kwargs: dict) -> dict:
    """Engine options a tensor-parallel engine needs on a host whose NVLink multicast is turned off
    (NCCL_NVLS_ENABLE=0 or TORCH_SYMM_MEM_DISABLE_MULTICAST=1): vLLM 0.26 fuses each all-reduce with
    the RMSNorm after it through FlashInfer's MNNVL all-reduce, which uses multicast memory, and
    a TP=2 engine on such a host has died in its first forward with an illegal memory access. The
    fusion is turned off unless the user gives a compilation_config of their own."""
    multicast_off = (os.environ.get("NCCL_NVLS_ENABLE") == "0"
                     or os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1")
    if int(engine_kwargs.get("tensor_parallel_size", 1)) > 1 and multicast_off \
            and "compilation_config" not in engine_kwargs:
        return {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    return {}


def _rpc(loop: LoopThread, llm, fn, kwargs: dict) -> list:
    """`fn(worker, **kwargs)` on every vLLM worker, their results."""
    return loop.run(llm.collective_rpc(fn, kwargs=kwargs))


def weights_dtype_name(dtype: str) -> str:
    """`rollout.dtype` as the canonical name of the model's weights' dtype (auto and fp8's
    unquantised weights: bfloat16), resolved once: the engine's `dtype` is torch's dtype of that
    name and vLLM is given the name (its ModelConfig.dtype lacks the recipe's bf16 / fp32 / fp16).
    The names the torch engine takes; another is refused before vLLM starts."""
    name = "bfloat16" if dtype in ("auto", "fp8") else WEIGHT_DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"vllm engine: unknown dtype {dtype!r}; use auto, fp8, {', '.join(WEIGHT_DTYPE_NAMES)}")
    return name


class VllmEngine(SyncTiming):
    name = "vllm"
    # with logprobs_mode="processed_logprobs" the reported log-prob is that of the distribution
    # after top-k/top-p renormalisation (module docstring)
    reports_untruncated_logprobs = False
    # vLLM keeps some tensors in another dtype than the model's (its MoE routers' gates in fp32):
    # a sync that rounds by the engine's dtype would give those a rounded value
    takes_stochastic_rounding = False

    def __init__(self, model_dir: str, *, device: str = "cuda", dtype: str = "auto",
                 max_batch: int = 64, max_len: int = 4096, seed: int = 0,
                 gpu_memory_utilization: float = 0.4, enable_prefix_caching: bool = True,
                 enforce_eager: bool = False, sync_bucket_mb: int = 512,
                 eos_token_ids: list[int] | None = None, trust_remote_code: bool = False,
                 request_seeds: bool = True, flat_logprobs: bool = False, **engine_kwargs):
        if not torch.cuda.is_available():
            raise RuntimeError("vllm engine: no CUDA device is visible")
        if "in_process" in engine_kwargs:
            raise ValueError("vllm engine: rollout.options in_process is gone: the engine always runs "
                             "vLLM's multi-process engine and syncs weights over CUDA IPC; remove the option")
        self.gpus = engine_gpus(device, int(engine_kwargs.get("tensor_parallel_size", 1)))
        self.device = torch.device("cuda", torch.device(device).index or 0)
        self.max_len, self.seed = int(max_len), int(seed)
        for option, value in (("request_seeds", request_seeds), ("flat_logprobs", flat_logprobs)):
            if not isinstance(value, bool):  # a quoted YAML "false" is a string
                raise ValueError(f"vllm engine: rollout.options {option} must be true or false, not {value!r}")
        self.request_seeds = request_seeds  # per-request seeds (module docstring: their cost)
        self.flat_logprobs = flat_logprobs  # vLLM's FlatLogprobs (module docstring: why)
        self.eos_token_ids = (list(eos_token_ids) if eos_token_ids is not None
                              else eos_token_ids_of(model_dir, trust_remote_code=trust_remote_code))
        # fp8: vLLM's own FP8 rollouts (weights quantised to e4m3 at load, FP8 GEMMs), bf16 around them
        fp8 = {"quantization": "fp8"} if dtype == "fp8" else {}
        if fp8:
            log.warning("vllm engine: quantization=fp8: the weight sync hands bf16 tensors to the FP8 model's "
                        "load_weights, and vLLM versions differ in whether that re-quantises them "
                        "(vllm-project/vllm#28425); watch the mismatch metrics (icepop/) of the first steps")
        weights_dtype = weights_dtype_name(dtype)
        self.dtype = getattr(torch, weights_dtype)
        engine_kwargs = {**_multicast_off_defaults(engine_kwargs), **engine_kwargs}
        kwargs = dict(model=model_dir, dtype=weights_dtype, seed=seed, **fp8,
                      trust_remote_code=trust_remote_code, max_model_len=max_len, max_num_seqs=max_batch,
                      gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
                      enforce_eager=enforce_eager, logprobs_mode="processed_logprobs", disable_log_stats=True,
                      **engine_kwargs)
        AsyncLLM, EngineArgs, self._SamplingParams, self._TokensPrompt, self._OutputKind = _import_vllm()
        # the weight sync's worker function travels to vLLM's processes by reference (vllm_weights.py)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        # The engine's processes are started fresh, never forked: this process's CUDA is often up
        # (the trainer's, a test's), and a forked engine core cannot use it. vLLM switches to spawn
        # by itself when it notices, but not always: engine cores forked so have died ("Cannot
        # re-initialize CUDA in forked subprocess"). A user's own setting stays.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self._loop = LoopThread()

        async def start():  # on the loop: AsyncLLM's output handler becomes a task of it
            return AsyncLLM.from_engine_args(EngineArgs(**kwargs))

        try:
            with _engine_environment(self.gpus):
                self.llm = self._loop.run(start())
        except BaseException:
            # vLLM's own error goes up as it is (the stage names it); the loop and its thread go
            # with the failed start (vLLM tears down its processes itself; what it leaves, the
            # stage's failed process ends with it: stages/common/entry.py)
            self._loop.close()
            raise
        # nothing here refers back to the engine: dropping it frees vLLM's processes (AsyncLLM's
        # own finaliser) and ends the loop thread, with no wait for the cycle collector
        self._weights = IpcWeightSender(functools.partial(_rpc, self._loop, self.llm), self.device,
                                        int(sync_bucket_mb) << 20)
        weakref.finalize(self, self._loop.close)
        self._calls = 0
        self.last_stats: dict[str, float] = {}
        self.last_sync = SyncReport()
        self.sleep_mode = bool(engine_kwargs.get("enable_sleep_mode", False))

    def close(self) -> None:
        """End the engine's processes (their GPU memory comes back) and its loop."""
        if getattr(self, "llm", None) is not None:
            self.llm.shutdown()
            self.llm = None
        self._loop.close()

    # ---------------------------------------------------------------- sleep
    def sleep(self, weights: bool = False) -> None:
        """The protocol's, through vLLM's sleep mode (module docstring)."""
        if not self.sleep_mode:
            raise RuntimeError("vllm engine: sleeping needs the engine built with rollout.options "
                               "{enable_sleep_mode: true}, or rollout.sleep: none")
        self._loop.run(self.llm.sleep(level=2 if weights else 1))

    def wake(self) -> None:
        if self.sleep_mode:
            self._loop.run(self.llm.wake_up())

    # ---------------------------------------------------------------- generate
    def _params(self, s: SamplingParams, r: RolloutRequest):
        seed = None if s.seed is None or not self.request_seeds else _request_seed(s.seed, r.uid, len(r.generated_ids))
        return self._SamplingParams(
            n=1, temperature=max(0.0, s.temperature), top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1, seed=seed, max_tokens=r.max_new_tokens,
            # our list is the only stop rule: vLLM also stops on the model's own EOS (its
            # generation config) unless told not to, so an engine opened with EOS off
            # (eos_token_ids=[]) still stopped at the model's EOS on an H100 (2026-11-26)
            logprobs=0, stop_token_ids=list(self.eos_token_ids), ignore_eos=True, detokenize=False,
            flat_logprobs=self.flat_logprobs, output_kind=self._OutputKind.FINAL_ONLY)

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams,
                 finished_token_budget: int | None = None) -> list[RolloutUpdate]:
        t0 = time.perf_counter()
        if sampling.temperature > MAX_TEMPERATURE:
            raise ValueError(f"vllm engine: temperature {sampling.temperature} is above {MAX_TEMPERATURE}, "
                             "the most vLLM samples at; lower the recipe's temperature or use rollout.engine: torch")
        for r in requests:
            need = len(r.prompt_ids) + len(r.generated_ids) + max(r.max_new_tokens, 0)
            if not r.prompt_ids or need > self.max_len:
                raise ValueError(f"vllm engine: request {r.uid!r}: empty prompt or "
                                 f"{need} tokens > max_len {self.max_len}")
        call = self._calls
        self._calls += 1
        done = [r.max_new_tokens <= 0 for r in requests]
        spent = sum(len(r.generated_ids) for r, d in zip(requests, done) if d)
        over = finished_token_budget is not None and spent >= finished_token_budget
        todo = {f"{call}-{i}-{r.uid}": i for i, r in enumerate(requests) if not done[i]}
        outs = {} if over or not todo else self._loop.run(self._decode(requests, sampling, todo, spent,
                                                                       finished_token_budget))
        updates = []
        for i, r in enumerate(requests):
            toks, lps, reason = outs.get(i, ([], [], "length" if done[i] else None))
            updates.append(RolloutUpdate(uid=r.uid, token_ids=toks, logprobs=lps,
                                         finished=reason is not None, finish_reason=reason))
        self.last_stats = {"seconds": time.perf_counter() - t0,
                           "new_tokens": sum(len(u.token_ids) for u in updates)}
        return updates

    async def _one(self, rid: str, r: RolloutRequest, sampling: SamplingParams):
        """One request's stream to its end: (tokens, logprobs, finish reason or None if aborted)."""
        final = None
        prompt = self._TokensPrompt(prompt_token_ids=r.prompt_ids + r.generated_ids)
        async for out in self.llm.generate(prompt, self._params(sampling, r), rid):
            final = out  # FINAL_ONLY: the one output at the end (or at an abort)
        if final is None:
            raise RuntimeError(f"vllm engine: request {r.uid!r}: vLLM ended its stream without an output")
        c = final.outputs[0]
        toks = list(c.token_ids)
        lps = _sampled_logprobs(r.uid, toks, c.logprobs)
        if len(lps) != len(toks):
            raise RuntimeError(f"vllm engine: request {r.uid!r}: {len(toks)} tokens but {len(lps)} logprobs")
        if c.finish_reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"vllm engine: request {r.uid!r} ended with finish_reason {c.finish_reason!r}")
        reason = {"stop": "eos", "length": "length"}.get(c.finish_reason)
        return toks, lps, reason

    async def _decode(self, requests: list[RolloutRequest], sampling: SamplingParams, todo: dict[str, int],
                      spent: int, budget: int | None) -> dict[int, tuple]:
        """Every request of `todo` (request id -> index) to its end, or until the finished
        rollouts' tokens (`spent` so far) reach `budget`: then the rest are aborted and keep
        what they have."""
        tasks = {asyncio.ensure_future(self._one(rid, requests[i], sampling)): rid for rid, i in todo.items()}
        results: dict[int, tuple] = {}
        idle = 0  # consecutive waits in which nothing finished and vLLM held none of our requests
        try:
            pending = set(tasks)
            while pending:
                finished, pending = await asyncio.wait(pending, timeout=STALL_CHECK_S,
                                                       return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    i = todo[tasks[task]]
                    results[i] = task.result()  # a request's error ends the call here
                    if results[i][2] is not None:
                        spent += len(requests[i].generated_ids) + len(results[i][0])
                if pending and budget is not None and spent >= budget:
                    await self.llm.abort([tasks[t] for t in pending])  # each stream then ends with what it has
                    for task in pending:
                        results[todo[tasks[task]]] = await task
                    pending = set()
                    continue
                idle = idle + 1 if not finished and not self.llm.output_processor.has_unfinished_requests() else 0
                if idle >= 2:  # twice: an output handed over as the wait timed out is not a loss
                    # vLLM holds none of our live requests: waiting on would wait for ever
                    # (the stage's first generate has gone silent so on an H100)
                    raise RuntimeError(f"vllm engine: {len(pending)} request(s) vanished from vLLM's scheduler "
                                       f"unfinished (e.g. {tasks[next(iter(pending))]!r})")
        finally:
            for task in tasks:
                task.cancel()  # a cancelled stream aborts its request in vLLM (only after an error)
        return results

    # ---------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        # vLLM's load_weights takes any subset of the weights: `partial` needs nothing more
        t0 = time.perf_counter()
        self.last_sync = self._weights.send((_strip(n), t) for n, t in named_tensors)
        reset_started = time.perf_counter()
        reset = self._loop.run(self.llm.reset_prefix_cache())
        self.last_sync.reset_seconds = time.perf_counter() - reset_started
        if not reset:
            log.warning("vllm engine: vLLM did not reset its prefix cache after the weight sync (requests still "
                        "held blocks): continued rollouts may reuse KV of the old weights (watch icepop/)")
        self._record_sync(t0)
        r = self.last_sync
        log.info("vllm engine: weight sync of %.2f GB in %d bucket(s): %.1f GB/s (copies %.3f s, rpc %.3f s: "
                 "map %.3f s, load_weights %.3f s; prefix-cache reset %.3f s)", r.bytes / 1e9, r.buckets,
                 r.gb_per_s, r.copy_seconds, r.rpc_seconds, r.map_seconds, r.load_seconds, r.reset_seconds)


def make_vllm_engine(model_dir: str, *, device: str = "cuda", dtype: str = "auto",
                     max_batch: int = 64, max_len: int = 4096, seed: int = 0,
                     **engine_options) -> VllmEngine:
    """engine_options: gpu_memory_utilization (0.4), enable_prefix_caching, enforce_eager,
    sync_bucket_mb (512), eos_token_ids, request_seeds (True), flat_logprobs (False), and any other `vllm.AsyncEngineArgs` keyword
    (tensor_parallel_size, enable_sleep_mode, ...)."""
    return VllmEngine(model_dir, device=device, dtype=dtype, max_batch=max_batch,
                      max_len=max_len, seed=seed, **engine_options)


VLLM_VERSION, VLLM_MISSING = _installed_vllm()
if VLLM_VERSION is None:
    UNAVAILABLE["vllm"] = (f"vllm is not installed here ({VLLM_MISSING}); it needs "
                           f"`pip install ring-pipeline[vllm]` on a CUDA machine")
elif _version_tuple(VLLM_VERSION) < MIN_VLLM:
    UNAVAILABLE["vllm"] = (f"vllm {VLLM_VERSION} is older than {'.'.join(map(str, MIN_VLLM))}, "
                           f"the API this engine is written against")
else:
    register_engine("vllm")(make_vllm_engine)
    if not torch.cuda.is_available():
        UNAVAILABLE["vllm"] = f"vllm {VLLM_VERSION} is installed but no CUDA device is visible"
