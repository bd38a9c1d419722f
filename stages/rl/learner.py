"""The policy update of one RL step: pi_train(theta_old) once, then the IcePop/TIS/GRPO loss.

    plan       the step's rollouts -> `updates_per_batch` mini-batches (one optimizer step
               each) -> per rank, micro-batches of at most `micro_batch_tokens` padded tokens
               (longest-first, balanced over ranks; every rank gets the same number of
               micro-batches, padded with dummy ones, so collective ops stay in step;
               micro_batches.py plans and collates them)
    theta_old  one no-grad pass over every micro-batch: log pi_train(theta_old) of each
               response token, its entropy, the reference log-probs when kl_coef > 0, and
               the mismatch statistics (loss.MismatchStats)
    update     for each epoch and mini-batch: forward with grad, `loss.policy_loss` with
               N = the mini-batch's rollout count, backward per micro-batch, one step

Both passes run the policy in train mode (gradient checkpointing, when on, works only in
train mode) with every dropout off (`PolicyHead` zeroes them when it wraps the model): theta_old
and theta are then the same function at the first update, so r == 1 there, as PPO's ratio
assumes. A model with other train-time randomness (MoE router jitter, ...) must have it
configured off.

Log-probs are those of the temperature-scaled distribution softmax(logits / T), the one the
engine samples from (the engine reports pi_infer of the same distribution). Logits are
computed only at response positions, in chunks of `logit_chunk` tokens of the whole
micro-batch (stages/common/fused_loss.py; recomputed in the backward pass when there is more
than one chunk), so neither a 64k-token response nor a wide micro-batch ever holds a
[tokens, vocab] tensor at once.

Attention: the micro batch's rows are right-padded, so a model whose attention is causal by
position needs no padding mask, and gets none (SDPA's flash kernel; `CAUSAL_BY_POSITION`).

Backends: `TorchBackend` (a plain torch optimizer; the GPU benchmark uses it) or the
DeepSpeed wrapper in deepspeed_backend.py. Each rank's micro-batch loss is multiplied by the world
size because data-parallel backends average gradients over ranks.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from stages.common.fused_loss import chunks_for, token_logprobs
from stages.common.lora import adapters_disabled
from stages.common.packed_attention import sdpa_without_cudnn
from stages.rl.loss import STAT_KEYS, LossConfig, MismatchStats, policy_loss
from stages.rl.micro_batches import MicroBatch, collate, plan_micro_batches
from stages.rl.routing import ROUTING_KEYS, RouterReplay, routing_metrics


class Backend(Protocol):
    module: "PolicyHead"  # the wrapped policy (its `.lm` is the Hugging Face model)
    device: torch.device
    rank: int
    world_size: int

    def forward(self, mb: "MicroBatch", temperature: float, chunk: int, with_entropy: bool,
                head_calls: int | None = None): ...

    def backward(self, loss: torch.Tensor, boundary: bool) -> None: ...

    def step(self) -> float:
        """Optimizer step (after gradient clipping); returns the gradient norm before clipping."""
        ...

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor: ...


class TorchBackend:
    """One process, a plain torch optimizer. `lm`: the causal LM (or an already wrapped PolicyHead)."""

    rank, world_size = 0, 1

    def __init__(self, lm: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None):
        self.module = lm if isinstance(lm, PolicyHead) else PolicyHead(lm)
        self.optimizer, self.grad_clip = optimizer, grad_clip
        self.device = next(self.module.parameters()).device
        self._params = [p for p in self.module.parameters() if p.requires_grad]

    def forward(self, mb: "MicroBatch", temperature: float, chunk: int, with_entropy: bool,
                head_calls: int | None = None):
        return self.module(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, temperature, chunk,
                           with_entropy, head_calls)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self._params, self.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return t


@dataclass
class LearnerConfig:
    loss: LossConfig
    pad_id: int
    temperature: float = 1.0
    micro_batch_tokens: int = 65536
    updates_per_batch: int = 1
    ppo_epochs: int = 1
    logit_chunk: int = 2048


# -- log-probs -----------------------------------------------------------------------------------
def _hidden_and_head(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or head is None:
        return None, None
    out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden, head


def response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      resp_pos: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int,
                      with_entropy: bool = False,
                      head_calls: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) of every response token, [B, R] (and the entropy at each).
    `attention_mask`: None = causal attention over whole rows (PolicyHead decides which).
    `head_calls`: how often to call the head (the same on every rank under ZeRO-3)."""
    hidden, head = _hidden_and_head(model, input_ids, attention_mask)
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if hidden is None:  # no separable head: full logits, identity "head"
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        head, softcap = torch.nn.Identity(), None
    H = hidden.shape[-1]
    h = hidden.gather(1, resp_pos.unsqueeze(-1).expand(-1, -1, H))  # [B, R, H]
    # chunks of `chunk` tokens over the whole micro batch, not per row: at most [chunk, vocab]
    # float32 logits exist at once however many rows the micro batch has
    return token_logprobs(h, head, targets, chunk, temperature=temperature, softcap=softcap,
                          with_entropy=with_entropy, head_calls=head_calls)


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of `model` off: dropout modules get p = 0, and so does the attention-dropout
    probability that Hugging Face attention modules keep as a float attribute (read in forward
    in train mode). The model's config is left as it is (a saved policy keeps its settings)."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)


# Model types whose attention is causal by position and whose positions count from each row's
# first token: on collate's right-padded rows (one rollout per row from position 0, pads after
# it) a real token attends only to real tokens before it, so these get no padding mask, and HF
# hands SDPA `is_causal` (its flash kernel; a [B, T] mask becomes a dense 4D one that rules it
# out). The pads' own outputs are never read (resp_pos points at real tokens). MoE types
# included: their routers pick experts per token with no capacity limit, so a pad cannot take a
# real token's place. Any other type keeps the mask: a causal mask is a per-model property (a
# config can switch it to bidirectional, e.g. gemma3's `use_bidirectional_attention`).
CAUSAL_BY_POSITION = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "ring_moe"})


class PolicyHead(torch.nn.Module):
    """The causal LM `lm` with a forward that returns response-token log-probs; its dropout is
    switched off (module docstring).

    The policy is wrapped (rather than its submodules called from outside) so that one
    `forward` of the training engine covers the whole computation: DeepSpeed (ZeRO-3 in
    particular) keeps per-micro-step state in its forward, which gradient accumulation needs.

    `keep_padding_mask`: pass collate's padding mask to the model even when its type is in
    CAUSAL_BY_POSITION (the same numbers, slower; benchmarks and tests compare the two)."""

    def __init__(self, lm: torch.nn.Module, keep_padding_mask: bool = False):
        super().__init__()
        disable_dropout(lm)
        self.lm = lm
        model_type = getattr(getattr(lm, "config", None), "model_type", None)
        self.uses_padding_mask = keep_padding_mask or model_type not in CAUSAL_BY_POSITION

    def forward(self, input_ids, attention_mask, resp_pos, targets, temperature: float, chunk: int,
                with_entropy: bool = False, head_calls: int | None = None):
        """`attention_mask`: [B, T], each row's ones first (collate's right padding)."""
        mask = attention_mask if self.uses_padding_mask else None
        return response_logprobs(self.lm, input_ids, mask, resp_pos, targets, temperature, chunk,
                                 with_entropy, head_calls)


# -- the update ----------------------------------------------------------------------------------
class Learner:
    """`ref_model`: the reference model of the KL term; or `ref_is_base`: the policy is a LoRA
    model, and its reference is the policy with its adapters off (stages/common/lora.py).
    `routing`: hooks on the policy's MoE routers (routing.py): the engine's expert choices are
    compared with the trainer's in the theta_old pass, and replayed in both passes when
    `routing.replay`; None = the policy routes by itself, nothing measured."""

    def __init__(self, backend: Backend, cfg: LearnerConfig, ref_model: torch.nn.Module | None = None,
                 ref_is_base: bool = False, routing: RouterReplay | None = None):
        if cfg.loss.kl_coef > 0 and ref_model is None and not ref_is_base:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.backend, self.cfg, self.ref_model = backend, cfg, ref_model
        self.ref_is_base = ref_is_base and cfg.loss.kl_coef > 0
        self.routing = routing

    def _routed(self, mb: "MicroBatch", measure: bool):
        """Within: the policy's routers see `mb`'s recorded routes (to measure or to replay)."""
        from contextlib import nullcontext

        if self.routing is None or (not measure and not self.routing.replay):
            return nullcontext()
        return self.routing.using(mb.routes, measure)

    def _split_updates(self, n: int, version: int) -> list[list[int]]:
        idx = list(range(n))
        random.Random(f"minibatches/{version}").shuffle(idx)
        u = min(self.cfg.updates_per_batch, n)
        return [sorted(idx[i::u]) for i in range(u)]

    def train(self, samples: Sequence[Any], version: int) -> dict[str, float]:
        """One RL step on `samples` (every rank passes the same list); returns metrics
        reduced over ranks. `version` = the policy version of theta_old.

        Forward and backward (recomputations included) run without SDPA's cuDNN kernel: its
        plans are built per shape, and micro batches change shape every step."""
        with sdpa_without_cudnn():
            return self._train(samples, version)

    def _micro_loss(self, lp: torch.Tensor, mb: MicroBatch, old: list[torch.Tensor],
                    ref: list[torch.Tensor] | None, n_seqs: int, sums: dict[str, float]) -> torch.Tensor:
        """The micro batch's loss (0 for a dummy one); its statistics added to `sums`."""
        if mb.dummy:
            return lp.sum() * 0.0
        out = policy_loss(lp, _stack(old, lp.shape), mb.infer_logp, mb.advantages, mb.mask, self.cfg.loss,
                          num_sequences=n_seqs, ref_logp=_stack(ref, lp.shape) if ref else None)
        for key, value in (("pg_loss", out.pg_loss), ("kl", out.kl), ("loss", float(out.loss.detach())),
                           ("clipped", out.clipped_tokens), ("kept", out.kept_tokens), ("tokens", out.tokens)):
            sums[key] += value
        return out.loss

    def _reduce_over_ranks(self, stats: MismatchStats,
                           sums: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """The step's mismatch / routing metrics and the summed `sums`, reduced over ranks."""
        be = self.backend
        routing = self.routing.take_counts() if self.routing is not None else dict.fromkeys(ROUTING_KEYS, 0.0)
        keys = list(STAT_KEYS) + list(sums) + list(ROUTING_KEYS)
        vec = torch.tensor([stats.sums[k] if k in stats.sums else 0.0 for k in STAT_KEYS] + [sums[k] for k in sums]
                           + [routing[k] for k in ROUTING_KEYS], dtype=torch.float64, device=be.device)
        mx = torch.tensor([stats.sums["abs_log_k_max"]], dtype=torch.float64, device=be.device)
        hist = be.all_reduce(torch.tensor(stats.hist, dtype=torch.float64, device=be.device), "sum")
        vec = be.all_reduce(vec, "sum")
        mx = be.all_reduce(mx, "max")
        red = dict(zip(keys, vec.tolist()))
        merged = MismatchStats({k: red[k] for k in STAT_KEYS}, hist.tolist())
        merged.sums["abs_log_k_max"] = float(mx[0])
        out = merged.finalize()
        out.update(routing_metrics({k: red[k] for k in ROUTING_KEYS}))
        return out, red

    def _train(self, samples: Sequence[Any], version: int) -> dict[str, float]:
        be, cfg = self.backend, self.cfg
        if not samples:
            raise ValueError("empty training batch")
        model = be.module
        ref_head = PolicyHead(self.ref_model) if self.ref_model is not None else None
        updates = self._plan_updates(samples, version)

        # theta_old: one pass, no grad, in the same (train) mode as the update
        t0 = time.perf_counter()
        model.train()
        old: dict[int, torch.Tensor] = {}
        ref_lps: dict[int, torch.Tensor] = {}
        stats = MismatchStats()
        with torch.no_grad():
            for _, mbs, calls in updates:
                for mb_idx, n_calls in zip(mbs, calls):
                    mb = collate([samples[i] for i in mb_idx], version, cfg.pad_id, be.device)
                    with self._routed(mb, measure=True):
                        lp, ent = be.forward(mb, cfg.temperature, cfg.logit_chunk, True, n_calls)
                    if ref_head is not None:
                        rlp, _ = ref_head(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, cfg.temperature,
                                          cfg.logit_chunk, False, n_calls)
                    elif self.ref_is_base:
                        with adapters_disabled(model):
                            rlp, _ = be.forward(mb, cfg.temperature, cfg.logit_chunk, False, n_calls)
                    if mb.dummy:
                        continue
                    stats.add(lp, mb.infer_logp, mb.mask, cfg.loss, entropy=ent, stale=mb.stale)
                    for b, i in enumerate(mb_idx):
                        old[i] = lp[b]
                        if self.ref_model is not None or self.ref_is_base:
                            ref_lps[i] = rlp[b]
        t_old = time.perf_counter() - t0

        # the update(s)
        t0 = time.perf_counter()
        sums = {"pg_loss": 0.0, "kl": 0.0, "loss": 0.0, "clipped": 0.0, "kept": 0.0, "tokens": 0.0}
        grad_norms = []
        for _ in range(cfg.ppo_epochs):
            for n_seqs, mbs, calls in updates:
                for j, mb_idx in enumerate(mbs):
                    mb = collate([samples[i] for i in mb_idx], version, cfg.pad_id, be.device)
                    # the routes stay set through the backward: gradient checkpointing re-runs the routers
                    with self._routed(mb, measure=False):
                        lp, _ = be.forward(mb, cfg.temperature, cfg.logit_chunk, False, calls[j])
                        loss = self._micro_loss(lp, mb, [old[i] for i in mb_idx],
                                                [ref_lps[i] for i in mb_idx] if ref_lps else None, n_seqs, sums)
                        be.backward(loss * be.world_size, boundary=(j == len(mbs) - 1))
                grad_norms.append(be.step())
        t_update = time.perf_counter() - t0

        return self._reduce(stats, sums, grad_norms, cfg.ppo_epochs * len(updates), t_old, t_update)

    def _plan_updates(self, samples: Sequence[Any], version: int) -> list[tuple[int, list[list[int]], list[int]]]:
        """Per update (mini-batch): (its sequences, this rank's micro batches of sample indices,
        the LM-head calls of each of them)."""
        be, cfg = self.backend, self.cfg
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]

        def head_calls(idx: list[int]) -> int:  # of a micro batch: its [B, R] response tokens in chunks
            return chunks_for(len(idx) * max(len(samples[i].response_ids) for i in idx), cfg.logit_chunk) if idx else 1

        updates = []
        for members in self._split_updates(len(samples), version):
            plan = [[[members[j] for j in mb] for mb in rank_plan]
                    for rank_plan in plan_micro_batches([lengths[i] for i in members], be.world_size,
                                                        cfg.micro_batch_tokens)]
            # every rank plans every rank's micro batches, so all agree on the head calls of the
            # j-th one without communicating (ZeRO-3: stages/common/fused_loss.py)
            calls = [max(head_calls(rank_plan[j]) for rank_plan in plan) for j in range(len(plan[be.rank]))]
            updates.append((len(members), plan[be.rank], calls))
        return updates

    def _reduce(self, stats: MismatchStats, sums: dict[str, float], grad_norms: list[float], n_updates: int,
                t_old: float, t_update: float) -> dict[str, float]:
        """The step's metrics, reduced over ranks."""
        out, red = self._reduce_over_ranks(stats, sums)
        out.update({
            "loss": red["loss"] / n_updates,
            "pg_loss": red["pg_loss"] / n_updates,
            "kl_ref": red["kl"] / n_updates,
            "clip_fraction": red["clipped"] / max(red["tokens"], 1.0),
            "kept_fraction": red["kept"] / max(red["tokens"], 1.0),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "optimizer_steps": float(n_updates),
            "old_logprob_seconds": t_old,
            "update_seconds": t_update,
        })
        return out


def _stack(rows: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape, dtype=rows[0].dtype, device=rows[0].device)
    for b, r in enumerate(rows):
        n = min(r.shape[0], shape[1])
        out[b, :n] = r[:n]
    return out
