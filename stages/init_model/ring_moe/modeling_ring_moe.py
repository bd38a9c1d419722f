"""Modelling code of `ring_moe` (custom code: copied into every model directory that uses it).

Per decoder layer (the module names of transformers' qwen2_moe, so tools that know that
layout, the rollout engine included, find everything where they expect it):
  self_attn.{q,k,v,o}_proj, input_layernorm, post_attention_layernorm, and either a dense
  `mlp` (the first `first_k_dense_replace` layers) or the MoE block:
  mlp.gate         the router: weight [E, d] and `expert_bias` [E];
                   forward(h [n, d]) -> (logits [n, E], top_k_weights [n, k], top_k_index [n, k])
  mlp.experts      gate_up_proj [E, 2*ff, d], down_proj [E, d, ff] (SwiGLU experts)
  mlp.shared_expert, mlp.shared_expert_gate   (the always-on expert, sigmoid-gated)

Routing (Ling 2.0 / DeepSeek-V3, aux-loss-free balancing): scores = sigmoid(logits) in fp32;
the experts are chosen by topk(scores + expert_bias) but weighted by their *unbiased*
scores, normalised over the chosen k (norm_topk_prob) and scaled by routed_scaling_factor.
The bias receives no gradient (top-k indices are not differentiable); pre-training adjusts
it from expert loads, and the RL recipe holds it fixed (`frozen_param_patterns`).
"""
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_utils import PreTrainedModel
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeAttention,
    Qwen2MoeDecoderLayer,
    Qwen2MoeExperts,
    Qwen2MoeForCausalLM,
    Qwen2MoeMLP,
    Qwen2MoeModel,
    Qwen2MoePreTrainedModel,
    Qwen2MoeRMSNorm,
    Qwen2MoeRotaryEmbedding,
    Qwen2MoeSparseMoeBlock,
)
from transformers.utils.output_capturing import OutputRecorder

from .configuration_ring_moe import RingMoeConfig


class RingMoeRouter(nn.Module):
    def __init__(self, config: RingMoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))
        self.expert_bias = nn.Parameter(torch.zeros(self.num_experts))

    def forward(self, hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, self.hidden_dim)
        # fp32 routing: in bf16 near-tied scores would pick experts by rounding noise
        logits = F.linear(h.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        _, top_k_index = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1)
        top_k_weights = scores.gather(-1, top_k_index)
        if self.norm_topk_prob:
            top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + 1e-20)
        top_k_weights = top_k_weights * self.routed_scaling_factor
        return logits, top_k_weights.to(h.dtype), top_k_index


class RingMoeSparseMoeBlock(Qwen2MoeSparseMoeBlock):
    """qwen2_moe's block (routed experts + gated shared expert) with the Ling router."""

    def __init__(self, config: RingMoeConfig):
        nn.Module.__init__(self)
        self.gate = RingMoeRouter(config)
        self.experts = Qwen2MoeExperts(config)
        self.shared_expert = Qwen2MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)


class RingMoeDecoderLayer(Qwen2MoeDecoderLayer):
    def __init__(self, config: RingMoeConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.self_attn = Qwen2MoeAttention(config, layer_idx)
        if layer_idx < config.first_k_dense_replace:
            self.mlp = Qwen2MoeMLP(config, intermediate_size=config.intermediate_size)
        else:
            self.mlp = RingMoeSparseMoeBlock(config)
        self.input_layernorm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_size = config.hidden_size


class RingMoePreTrainedModel(Qwen2MoePreTrainedModel):
    config_class = RingMoeConfig
    config: RingMoeConfig
    _no_split_modules = ["RingMoeDecoderLayer"]
    _can_record_outputs = {
        "router_logits": OutputRecorder(RingMoeRouter, index=0),
        "hidden_states": RingMoeDecoderLayer,
        "attentions": Qwen2MoeAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, RingMoeRouter):
            module.weight.normal_(mean=0.0, std=self.config.initializer_range)
            module.expert_bias.zero_()


class RingMoeModel(RingMoePreTrainedModel, Qwen2MoeModel):
    def __init__(self, config: RingMoeConfig):
        PreTrainedModel.__init__(self, config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [RingMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen2MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class RingMoeForCausalLM(RingMoePreTrainedModel, Qwen2MoeForCausalLM):
    def __init__(self, config: RingMoeConfig):
        PreTrainedModel.__init__(self, config)
        self.model = RingMoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts = config.num_experts
        self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()


class RingMoeForSequenceClassification(GenericForSequenceClassification, RingMoePreTrainedModel):
    """A scalar head on the last token (the reward model)."""

    def __init__(self, config: RingMoeConfig):
        PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = RingMoeModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


__all__ = ["RingMoeForCausalLM", "RingMoeForSequenceClassification", "RingMoeModel", "RingMoePreTrainedModel"]
