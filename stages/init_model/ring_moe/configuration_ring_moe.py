"""Configuration of `ring_moe` (custom code: copied into every model directory that uses it).

The layout is transformers' qwen2_moe (attention, RMSNorms, fused 3-D expert weights, a
gated shared expert) with the router of Ling 2.0 / DeepSeek-V3: sigmoid scores, an expert
bias that only picks the top-k experts, the picked scores normalised and scaled by
`routed_scaling_factor`. The first `first_k_dense_replace` layers have a dense MLP instead
of experts (Ling's first layer is dense)."""
from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig


class RingMoeConfig(Qwen2MoeConfig):
    model_type = "ring_moe"

    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self, **kwargs):
        # the dense layers are qwen2_moe's `mlp_only_layers`; one setting, not two
        if self.first_k_dense_replace < 0 or self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace ({self.first_k_dense_replace}) must be within "
                             f"[0, num_hidden_layers={self.num_hidden_layers}]")
        self.mlp_only_layers = list(range(self.first_k_dense_replace))
        self.decoder_sparse_step = 1
        super().__post_init__(**kwargs)


__all__ = ["RingMoeConfig"]
