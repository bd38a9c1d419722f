"""The rollout (inference) engine protocol and its registry.

An engine samples continuations and reports, per generated token, the token's
log-probability under the engine itself (pi_infer). It is a different code path from the
trainer's full-sequence forward (KV-cached batched decoding; bf16 on GPU), which is the
train-inference mismatch IcePop corrects.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Protocol

import torch

log = logging.getLogger(__name__)

# wrappers whose prefix a trainer's parameter names may carry: DeepSpeed engine, torch.compile
IGNORED_PREFIXES = ("module.", "_orig_mod.")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None


@dataclass
class RolloutRequest:
    """One rollout to decode: its prompt and the response tokens it already has.

    `generated_ids` is non-empty when C3PO++ carries an unfinished rollout over a
    weight update: the engine continues from prompt + generated_ids with its current
    weights (the prefix is re-encoded, not reused from a stale KV cache).
    """

    uid: str
    prompt_ids: list[int]
    max_new_tokens: int  # how many more tokens this rollout may still generate
    generated_ids: list[int] = field(default_factory=list)


@dataclass
class RolloutUpdate:
    """What one `generate` call added to a request."""

    uid: str
    token_ids: list[int]
    # pi_infer of each new token, same length as token_ids: log_softmax(logits / temperature)
    # at the token (greedy: temperature 1); compare with the trainer's log_softmax of its
    # logits divided by the same temperature
    logprobs: list[float]
    finished: bool
    finish_reason: Literal["eos", "length"] | None = None
    # MoE engines that record routing (torch): the experts each MoE layer chose at every position
    # of prompt + all generated tokens the engine fed through the model in this call, a numpy
    # int16 array [positions, MoE layers, k] (-1 = none); None otherwise (routes.py, ../routing.py)
    routes: Any = None


class RolloutEngine(Protocol):
    name: str
    last_sync_seconds: float | None  # wall time of the latest update_weights (None before one)
    # True when a token's reported log-prob is that of the untruncated softmax(logits / T),
    # whatever top_p / top_k do to the sampling (what IcePop / TIS need; stages/rl/settings.py)
    reports_untruncated_logprobs: bool
    # True when the engine holds every tensor the weight sync sends in its one `dtype`: what
    # stochastic sync rounding needs (stages/rl/stochastic_rounding.py; stages/rl/settings.py)
    takes_stochastic_rounding: bool
    dtype: torch.dtype  # of the weights update_weights writes (bf16: what stochastic sync rounding needs)

    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams,
                 finished_token_budget: int | None = None) -> list[RolloutUpdate]:
        """Decode all requests concurrently, one update per request, in request order.

        Without a budget: until every request finishes (EOS or its max_new_tokens).
        With a budget: stop all decoding as soon as the summed response length
        (earlier + new tokens) of the requests that finished in this call reaches the
        budget; the unfinished ones return the tokens they got so far.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Load new policy weights in place (after every trainer update). `partial`: only the
        tensors training changed (a LoRA policy's merged layers); the engine keeps the rest."""
        ...

    def sleep(self, weights: bool = False) -> None:
        """Release the engine's device memory while a colocated trainer steps: its KV cache
        (and whatever depends on it, e.g. captured CUDA graphs), and with `weights` its copy
        of the weights too. Nothing may be generated until `wake()`."""
        ...

    def wake(self) -> None:
        """Undo `sleep`. Weights released by `sleep(weights=True)` come back as allocated but
        undefined storage: `update_weights` must fill them before the next `generate`."""
        ...


class SyncTiming:
    """The weight-sync bookkeeping every engine keeps: `last_sync_seconds` (the protocol's)
    and their count. An engine's update_weights ends with `self._record_sync(t0)`."""

    name: str
    last_sync_seconds: float | None = None
    syncs: int = 0

    def _record_sync(self, started: float) -> None:
        self.last_sync_seconds = time.perf_counter() - started
        self.syncs += 1
        log.info("%s engine: weight sync %d took %.3f s", self.name, self.syncs, self.last_sync_seconds)


# Every factory has the signature
#   (model_dir: str, *, device: str = "cpu", dtype: str = "auto", max_batch: int = 64,
#    max_len: int = 4096, seed: int = 0, trust_remote_code: bool = False,
#    **engine_options) -> RolloutEngine
# (trust_remote_code: run the model dir's own modelling code; stages/common/hf_io.py)
EngineFactory = Callable[..., RolloutEngine]
ENGINES: dict[str, EngineFactory] = {}
UNAVAILABLE: dict[str, str] = {}  # engine name -> why it cannot be used on this machine


def register_engine(name: str) -> Callable[[EngineFactory], EngineFactory]:
    def deco(factory: EngineFactory) -> EngineFactory:
        ENGINES[name] = factory
        return factory
    return deco
