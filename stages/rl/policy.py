"""The trainable policy of an RL stage: the HF causal LM under DeepSpeed (ZeRO stage from the
config, a torch AdamW over its trainable parameters; with `lora:` the adapters only), the
reference model when `kl_coef > 0` (a LoRA policy's reference is the policy with its adapters
off: no second copy), and the learner (learner.py) that updates it through `DeepSpeedBackend`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stages.common.compile_layers import compile_decoder_layers
from stages.common.contract import StageError
from stages.common.deepspeed_setup import ds_config, freeze_parameters, initialize
from stages.common.distributed import Ranks
from stages.common.hf_io import load_causal_lm
from stages.common.lora import apply_lora
from stages.rl.learner import Learner, LearnerConfig, PolicyHead
from stages.rl.loss import LossConfig
from stages.rl.routing import RouterReplay, moe_routers
from stages.rl.settings import ROUTE_RECORDING_ENGINES, RLConfig


class DeepSpeedBackend:
    """learner.Backend over a DeepSpeed engine: gradient accumulation with a caller-chosen
    boundary (the number of micro-batches varies from step to step)."""

    def __init__(self, engine, device: torch.device):
        self.engine, self.module, self.device = engine, engine.module, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def forward(self, mb, temperature: float, chunk: int, with_entropy: bool, head_calls: int | None = None):
        # through the engine's forward: ZeRO-3 counts micro-steps there (gradient accumulation)
        return self.engine(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, temperature, chunk,
                           with_entropy, head_calls)

    def backward(self, loss, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)

    def step(self) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        manual = None
        if not self.engine.zero_optimization():  # DS keeps no norm for plain fp32 data parallel
            grads = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
            manual = float(torch.stack(grads).norm()) if grads else 0.0
        self.engine.step()
        if manual is not None:
            return manual
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def all_reduce(self, t, op: str):
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t


def policy_ds_config(cfg: RLConfig, precision: str) -> dict[str, Any]:
    """One micro-batch per DeepSpeed step: accumulation boundaries are set by the learner.
    `precision`: resolved, "bf16" or "fp32" (the RL stages' choices)."""
    return ds_config(cfg.zero_stage, cfg.grad_clip, precision)


@dataclass
class Policy:
    ds_engine: Any          # DeepSpeed engine over learner.PolicyHead
    learner: Learner
    frozen: list[str]       # names of the parameters held fixed

    @property
    def module(self) -> torch.nn.Module:
        """The Hugging Face model being trained (inside PolicyHead)."""
        return self.ds_engine.module.lm


def build_policy(cfg: RLConfig, model_dir: Path, ranks: Ranks, precision: str, pad_id: int) -> Policy:
    """`cfg.model` loaded, `frozen_param_patterns` frozen, its decoder layers compiled when
    `compile_layers` (stages/common/compile_layers.py), wrapped in the learner's PolicyHead
    (which switches its dropout off) under DeepSpeed, with the reference model when
    `kl_coef > 0`."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = load_causal_lm(model_dir, dtype, trust_remote_code=cfg.trust_remote_code)
    if cfg.lora is not None:
        apply_lora(model, cfg.lora)
    frozen = freeze_parameters(model, cfg.frozen_param_patterns)
    if cfg.gradient_checkpointing is True:  # `auto` is decided before launch (speed_defaults.py)
        model.gradient_checkpointing_enable()
    if cfg.compile_layers is True:  # micro batches change shape every call; the reference model stays eager
        compile_decoder_layers(model, cfg.model, dynamic=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ds_engine, _ = initialize(PolicyHead(model), trainable, policy_ds_config(cfg, precision), lr=cfg.lr,
                              betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
    ref_model = None
    if cfg.kl_coef > 0 and cfg.lora is None:  # a LoRA policy's reference is itself, adapters off
        ref_model = load_causal_lm(model_dir, dtype, trust_remote_code=cfg.trust_remote_code).to(ranks.device).eval()
        ref_model.requires_grad_(False)
    high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
    loss_cfg = LossConfig(correction=cfg.correction, alpha=cfg.icepop_alpha, beta=cfg.icepop_beta,
                          clip_eps_low=cfg.clip_eps, clip_eps_high=high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef)
    learner = Learner(DeepSpeedBackend(ds_engine, ranks.device),
                      LearnerConfig(loss=loss_cfg, pad_id=pad_id, temperature=cfg.temperature,
                                    micro_batch_tokens=cfg.micro_tokens, updates_per_batch=cfg.updates_per_batch,
                                    ppo_epochs=cfg.ppo_epochs, logit_chunk=cfg.logit_chunk),
                      ref_model=ref_model, ref_is_base=cfg.lora is not None, routing=router_hooks(cfg, model))
    return Policy(ds_engine, learner, frozen)


def router_hooks(cfg: RLConfig, model: torch.nn.Module) -> RouterReplay | None:
    """A MoE policy whose engine records routes gets the learner's router hooks (routing.py):
    the expert-choice disagreement is measured in every such run, replayed when
    `routing_replay` (settings.py refuses it with an engine that records none). A policy the
    hooks cannot replay (no MoE block, a router without a replay rule) is a StageError."""
    if not cfg.routing_replay and (cfg.rollout.engine not in ROUTE_RECORDING_ENGINES or not moe_routers(model)):
        return None
    try:
        return RouterReplay(model, replay=cfg.routing_replay)
    except ValueError as e:
        raise StageError(f"{cfg.model}: {e}") from None
