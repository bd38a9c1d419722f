"""Which attention implementation a training stage gets (`choose_attention`, for every stage
that trains under DeepSpeed), and what packed sequences (several samples in one row, position
ids restarting at 0 for each) need of it: which implementation keeps samples apart without a
dense [T, T] mask, and the batch shape it wants.

transformers (5.x) finds the samples of a row from its restarting position ids (when there is
no attention mask and no cache) and then, per implementation:
- flash_attention_2: varlen kernels over the samples (needs the flash-attn package, and the
  micro batch flattened into one row);
- flex_attention: a document-causal BlockMask, so FlexAttention skips the blocks that cross
  samples (a compiled Triton kernel: GPU only, it has no backward on CPU);
- sdpa / eager: a dense boolean [B, 1, T, T] mask (T^2 bytes per row: 256 MB at 16k tokens),
  which also keeps SDPA off its flash kernel. Correct everywhere; the CPU choice.

FlexAttention is compiled for each new shape; batches are padded to one fixed width
(`static_width`) so that it compiles once.
"""
from __future__ import annotations

import torch

from stages.common.contract import StageError

FLEX_BLOCK = 128  # FlexAttention's block size: widths are rounded up to it


def sdpa_without_cudnn():
    """A context in which SDPA takes its flash, memory-efficient or math kernel, never cuDNN's.

    cuDNN's attention (SDPA's first choice on Hopper in torch 2.11) builds an execution plan for
    every new shape; the RL learner's micro batches and the rollout engine's prefills have a new
    shape almost every call. On one H100 leaving it out cuts C3PO++'s prefills from 0.82 to 0.27 s
    a step and the learner's update from 1.45 to 0.93 s (benchmarks/c3po_speedup.py --no-cudnn-sdpa);
    with a repeated shape (plan cached) it makes no difference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def choose_attention(requested: str, on_gpu: bool, field: str = "attn_implementation",
                     packed: bool = False) -> str:
    """The attention implementation to train with: `requested` unless "auto" (GPU:
    flash_attention_2 when flash-attn is installed, else flex_attention for packed batches and
    sdpa for the rest; CPU: sdpa). A choice that cannot run here is a StageError naming `field`.

    Packed batches take flex_attention over sdpa's dense block-diagonal mask because the `sft`
    stage trained 1.55x faster with it (benchmarks/sft_throughput.py, H100, Qwen2-1.5B shape at
    4096 tokens: 13.4k vs 8.7k tokens/s)."""
    if requested == "auto":
        if not on_gpu:
            return "sdpa"
        if _has_flash_attn():
            return "flash_attention_2"
        return "flex_attention" if packed else "sdpa"
    if requested == "flex_attention" and not on_gpu:
        raise StageError(f"{field}: flex_attention needs a GPU (FlexAttention has no backward pass on CPU); "
                         "use auto or sdpa")
    if requested == "flash_attention_2" and not (on_gpu and _has_flash_attn()):
        raise StageError(f"{field}: flash_attention_2 needs a GPU and the flash-attn package; use auto")
    return requested


def flattens_micro_batch(attn: str) -> bool:
    """flash-attention's varlen path detects packing from the position ids of a single row only."""
    return attn == "flash_attention_2"


def static_width(attn: str, max_seq_len: int) -> int | None:
    """The width every batch is padded to (None: batches keep their own width)."""
    if attn != "flex_attention":
        return None
    return -(-max_seq_len // FLEX_BLOCK) * FLEX_BLOCK


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: per token, the index of its sample in the row. A sample starts wherever a
    position does not follow the one before it (transformers' own rule, masking_utils'
    find_packed_sequence_indices), so a padding segment (positions from 0) is a sample of its own."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def document_causal_mask_mod(position_ids: torch.Tensor):
    """The FlexAttention mask_mod of packed rows: causal, and only within a token's own sample (what
    transformers builds from restarting position ids: its causal and packed-sequence mask functions)."""
    doc = document_ids(position_ids)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])
    return mask_mod


def document_block_mask(position_ids: torch.Tensor):
    """The document-causal BlockMask of packed rows, built on their device without reading anything on
    the host; given to the model as its attention mask, transformers uses it as it is. transformers' own
    builder first checks on the host whether any row holds more than one sample (`.all()` on a GPU
    tensor): a device sync at every forward, after which the GPU waits for the host to queue the next
    kernels. Compiled on CUDA as transformers compiles its own."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, width = position_ids.shape
    return create_block_mask(document_causal_mask_mod(position_ids), rows, None, width, width,
                             device=position_ids.device, _compile=position_ids.is_cuda)


def pad_packed_batch(batch: dict[str, torch.Tensor], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """`batch` (input_ids, targets, position_ids: [B, L], L <= width) padded on the right to
    `width` with one more segment per row: pad tokens, targets -100, positions from 0 (so the
    padding is a sample of its own and no real token attends to it)."""
    B, L = batch["input_ids"].shape
    extra = width - L
    if extra < 0:
        raise ValueError(f"batch width {L} exceeds the static width {width}")
    if extra == 0:
        return batch
    fill = {"input_ids": torch.full((B, extra), pad_id, dtype=torch.long),
            "targets": torch.full((B, extra), -100, dtype=torch.long),
            "position_ids": torch.arange(extra, dtype=torch.long).expand(B, extra)}
    return {k: torch.cat([v, fill[k].to(v.device)], dim=1) if k in fill else v for k, v in batch.items()}
