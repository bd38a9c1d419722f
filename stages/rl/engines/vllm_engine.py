"""The `vllm` rollout engine (GPU): vLLM sampling with per-token logprobs, weights updated
in place after every trainer update, unfinished rollouts continued by resubmission.

Written against vLLM 0.26 (the release that pins the GPU machines' torch 2.11), run there
(benchmarks/RESULTS.md); CI has neither vLLM nor a GPU and drives this module against a
stand-in of the same API (tests/stages/rl/test_engines.py). The calls it makes:
- `vllm.LLM(model=..., dtype=..., seed=..., max_model_len=..., max_num_seqs=...,
  gpu_memory_utilization=..., enable_prefix_caching=..., logprobs_mode="processed_logprobs")`:
  the returned logprob is that of the temperature-scaled distribution, like the torch
  engine's. "Processed" also applies top-k / top-p renormalisation (the torch engine reports
  pre-truncation logprobs), so `reports_untruncated_logprobs` is False and the recipe guard
  refuses top_p < 1 / top_k > 0 with IcePop or TIS on this engine.
- `llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=...), params)`,
  `llm.llm_engine.step() -> list[RequestOutput]` and `abort_request([ids])`: the stepping
  loop that implements the finished-token budget (C3PO++): once the finished rollouts'
  lengths reach the budget the rest are aborted and return what they have. Outputs carry the
  request id we gave (vLLM suffixes its internal ids, not ours).
- `SamplingParams(n=1, temperature, top_p, top_k (-1 = off), seed, max_tokens, logprobs=0,
  stop_token_ids, ignore_eos=True, detokenize=False, output_kind=DELTA)`: `logprobs=0`
  returns the sampled token's logprob only; DELTA outputs carry only each step's new tokens
  (cumulative ones would copy whole 64k-token rollouts every step); finish_reason "stop"
  (EOS / stop token) -> "eos", "length" -> "length".
- Seeds: each request carries a seed derived from (seed, uid, offset), so a rollout's tokens do
  not depend on the batch it ran in (as on the torch engine). vLLM then draws each seeded
  request's noise in a loop of its own (vllm/v1/sample/ops/topk_topp_sampler.py); round 8
  measured no cost from that (benchmarks/RESULTS.md: 22.2k tok/s with per-request seeds, 15.9k
  with the generator seeded once per call instead).
- Weights: `llm.collective_rpc(fn, kwargs=...)` runs `fn(worker, ...)` on the worker, which
  feeds the model's own `load_weights(iterable of (hf_name, tensor))` (vLLM's loader stacks
  q/k/v and gate/up and skips a tied lm_head). In process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
  set here unless `in_process=False`) the tensors are handed over without a copy; in a
  separate worker process they are pickled (slow: small models only). Then the prefix cache
  is reset (`llm.reset_prefix_cache()`), so a continued rollout's prefix is re-encoded with
  the new weights instead of reusing KV computed by the old ones.
- Sleep (colocated placement, while the trainer steps): `llm.sleep(level)` / `llm.wake_up()`
  (V1's sleep mode, which needs the `enable_sleep_mode=True` LLM keyword: `rollout.options`).
  Level 1 drops the KV cache and offloads the weights to CPU memory; level 2 (`weights`)
  drops both, and the weight sync after `wake()` refills them.

The model lives on the process's first visible GPU (vLLM uses cuda:0 of
CUDA_VISIBLE_DEVICES); ask for device "cuda" / "cuda:0" and pin the GPU with
CUDA_VISIBLE_DEVICES per process.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import time
from typing import Iterable

import torch

from stages.common.hf_io import eos_token_ids_of

from .protocol import IGNORED_PREFIXES, UNAVAILABLE, RolloutRequest, RolloutUpdate, SamplingParams, SyncTiming, register_engine

log = logging.getLogger(__name__)

MIN_VLLM = (0, 26)  # the API this module is written against (module docstring)


def _installed_vllm() -> tuple[str | None, str | None]:
    """(vLLM's version, None), or (None, why it is not there), without importing it: importing
    vLLM takes seconds and probes CUDA, and every process that imports the engine registry
    would pay it (the stage entries, and with them the verifier workers, which multiprocessing
    starts by importing the stage's main module: round 8, benchmarks/RESULTS.md)."""
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
        from vllm import LLM
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
    except Exception as e:  # ImportError, or a broken CUDA/vLLM install raising anything else
        raise RuntimeError(f"vllm engine: vllm is installed but does not import: {type(e).__name__}: {e}") from e
    return LLM, VllmSamplingParams, TokensPrompt, RequestOutputKind


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _load_weights(worker, weights) -> None:
    """Runs on vLLM's worker (collective_rpc): the model's own loader takes HF names."""
    worker.model_runner.model.load_weights(weights)


def _strip(name: str) -> str:
    while name.startswith(IGNORED_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def _request_seed(seed: int, uid: str, offset: int) -> int:
    h = hashlib.blake2b(f"{seed}:{uid}:{offset}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF


class VllmEngine(SyncTiming):
    name = "vllm"
    # with logprobs_mode="processed_logprobs" the reported log-prob is that of the distribution
    # after top-k/top-p renormalisation (module docstring)
    reports_untruncated_logprobs = False

    def __init__(self, model_dir: str, *, device: str = "cuda", dtype: str = "auto",
                 max_batch: int = 64, max_len: int = 4096, seed: int = 0,
                 gpu_memory_utilization: float = 0.4, enable_prefix_caching: bool = True,
                 enforce_eager: bool = False, in_process: bool = True,
                 eos_token_ids: list[int] | None = None, trust_remote_code: bool = False, **llm_kwargs):
        if not torch.cuda.is_available():
            raise RuntimeError("vllm engine: no CUDA device is visible")
        dev = torch.device(device)
        if dev.type != "cuda" or (dev.index or 0) != 0:
            raise ValueError(f"vllm engine: device must be 'cuda' or 'cuda:0' (vLLM uses the first "
                             f"visible GPU; choose it with CUDA_VISIBLE_DEVICES), got {device!r}")
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.max_len, self.seed = int(max_len), int(seed)
        self.eos_token_ids = (list(eos_token_ids) if eos_token_ids is not None
                              else eos_token_ids_of(model_dir, trust_remote_code=trust_remote_code))
        # fp8: vLLM's own FP8 rollouts (weights quantised to e4m3 at load, FP8 GEMMs), bf16 around them
        fp8 = {"quantization": "fp8"} if dtype == "fp8" else {}
        if fp8:
            log.warning("vllm engine: quantization=fp8: the weight sync hands bf16 tensors to the FP8 model's "
                        "load_weights, and vLLM versions differ in whether that re-quantises them "
                        "(vllm-project/vllm#28425); watch the mismatch metrics (icepop/) of the first steps")
        kwargs = dict(model=model_dir, dtype="bfloat16" if dtype in ("auto", "fp8") else dtype, seed=seed, **fp8,
                      trust_remote_code=trust_remote_code,
                      max_model_len=max_len, max_num_seqs=max_batch,
                      gpu_memory_utilization=gpu_memory_utilization,
                      enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                      **llm_kwargs)
        LLM, self._SamplingParams, self._TokensPrompt, self._OutputKind = _import_vllm()
        self.llm = LLM(**kwargs, logprobs_mode="processed_logprobs")
        self._calls = 0
        self.last_stats: dict[str, float] = {}
        self.sleep_mode = bool(llm_kwargs.get("enable_sleep_mode", False))

    # ---------------------------------------------------------------- sleep
    def sleep(self, weights: bool = False) -> None:
        """The protocol's, through vLLM's sleep mode (module docstring)."""
        if not self.sleep_mode:
            raise RuntimeError("vllm engine: sleeping needs the engine built with rollout.options "
                               "{enable_sleep_mode: true}, or rollout.sleep: none")
        self.llm.sleep(level=2 if weights else 1)

    def wake(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()

    # ---------------------------------------------------------------- generate
    def _params(self, s: SamplingParams, r: RolloutRequest):
        seed = None if s.seed is None else _request_seed(s.seed, r.uid, len(r.generated_ids))
        return self._SamplingParams(
            n=1, temperature=max(0.0, s.temperature), top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1, seed=seed, max_tokens=r.max_new_tokens,
            # our list is the only stop rule: vLLM also stops on the model's own EOS (its
            # generation config) unless told not to, so an engine opened with EOS off
            # (eos_token_ids=[]) still stopped at the model's EOS on an H100 (2026-11-26)
            logprobs=0, stop_token_ids=list(self.eos_token_ids), ignore_eos=True, detokenize=False,
            output_kind=self._OutputKind.DELTA)

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams,
                 finished_token_budget: int | None = None) -> list[RolloutUpdate]:
        t0 = time.perf_counter()
        for r in requests:
            need = len(r.prompt_ids) + len(r.generated_ids) + max(r.max_new_tokens, 0)
            if not r.prompt_ids or need > self.max_len:
                raise ValueError(f"vllm engine: request {r.uid!r}: empty prompt or "
                                 f"{need} tokens > max_len {self.max_len}")
        call = self._calls
        self._calls += 1
        engine = self.llm.llm_engine
        n = len(requests)
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        reason: list[str | None] = [None] * n
        done_tokens = 0
        live: dict[str, int] = {}

        def over_budget() -> bool:
            return finished_token_budget is not None and done_tokens >= finished_token_budget

        for i, r in enumerate(requests):
            if r.max_new_tokens <= 0:
                reason[i] = "length"
                done_tokens += len(r.generated_ids)
        try:
            if not over_budget():
                for i, r in enumerate(requests):
                    if reason[i] is None:
                        rid = f"{call}-{i}-{r.uid}"
                        engine.add_request(rid, self._TokensPrompt(prompt_token_ids=r.prompt_ids + r.generated_ids),
                                           self._params(sampling, r))
                        live[rid] = i
            while live and not over_budget():
                outs = engine.step()
                if not outs and not engine.has_unfinished_requests():
                    # vLLM holds none of our live requests: waiting on would spin for ever
                    # (the stage's first generate went silent on an H100 twice, rounds 5b and 7)
                    raise RuntimeError(f"vllm engine: {len(live)} request(s) vanished from vLLM's "
                                       f"scheduler unfinished (e.g. {next(iter(live))!r})")
                for out in outs:
                    i = live.get(out.request_id)
                    if i is None:
                        continue
                    c = out.outputs[0]  # DELTA: this step's new tokens only
                    toks[i] += c.token_ids
                    lps[i] += [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs or [])]
                    if len(lps[i]) != len(toks[i]):
                        raise RuntimeError(f"vllm engine: request {requests[i].uid!r}: "
                                           f"{len(toks[i])} tokens but {len(lps[i])} logprobs")
                    if out.finished:
                        del live[out.request_id]
                        reason[i] = "length" if c.finish_reason == "length" else "eos"
                        if c.finish_reason not in ("stop", "length"):
                            raise RuntimeError(f"vllm engine: request {requests[i].uid!r} ended "
                                               f"with finish_reason {c.finish_reason!r}")
                        done_tokens += len(requests[i].generated_ids) + len(toks[i])
        finally:
            if live:  # over budget (or an error): the rest keep what they have
                engine.abort_request(list(live))
        self.last_stats = {"seconds": time.perf_counter() - t0,
                           "new_tokens": sum(len(t) for t in toks)}
        return [RolloutUpdate(uid=r.uid, token_ids=toks[i], logprobs=lps[i],
                              finished=reason[i] is not None, finish_reason=reason[i])
                for i, r in enumerate(requests)]

    # ---------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        # vLLM's load_weights takes any subset of the weights: `partial` needs nothing more
        t0 = time.perf_counter()
        weights = ((_strip(n), t.detach()) for n, t in named_tensors)
        self.llm.collective_rpc(_load_weights, kwargs={"weights": weights})
        self.llm.reset_prefix_cache()
        torch.cuda.synchronize()
        self._record_sync(t0)


def make_vllm_engine(model_dir: str, *, device: str = "cuda", dtype: str = "auto",
                     max_batch: int = 64, max_len: int = 4096, seed: int = 0,
                     **engine_options) -> VllmEngine:
    """engine_options: gpu_memory_utilization (0.4), enable_prefix_caching, enforce_eager,
    in_process, eos_token_ids, and any other `vllm.LLM` keyword (tensor_parallel_size, ...)."""
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
