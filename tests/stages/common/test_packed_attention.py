"""Which attention a training stage gets, the errors for a choice that cannot run here, and
padding a packed batch to a static width."""
from __future__ import annotations

import pytest
import torch

from stages.common.contract import StageError
from stages.common.packed_attention import FLEX_BLOCK, choose_attention, flattens_micro_batch, pad_packed_batch, static_width


def test_auto_is_sdpa_on_cpu_and_varlen_flash_attention_on_gpu_when_installed():
    assert choose_attention("auto", on_gpu=False) == "sdpa"
    assert choose_attention("auto", on_gpu=False, packed=True) == "sdpa"
    try:
        import flash_attn  # noqa: F401
        want, want_packed = "flash_attention_2", "flash_attention_2"
    except ImportError:  # packed batches: FlexAttention's document mask (measured faster than sdpa's dense mask)
        want, want_packed = "sdpa", "flex_attention"
    assert choose_attention("auto", on_gpu=True) == want
    assert choose_attention("auto", on_gpu=True, packed=True) == want_packed
    assert choose_attention("flex_attention", on_gpu=True) == "flex_attention"
    for explicit in ("sdpa", "eager"):
        assert choose_attention(explicit, on_gpu=False) == explicit


@pytest.mark.parametrize("requested,problem", [("flex_attention", "needs a GPU"),
                                               ("flash_attention_2", "needs a GPU and the flash-attn package")])
def test_a_kernel_that_cannot_run_here_is_a_stage_error_naming_the_field(requested, problem):
    with pytest.raises(StageError, match=f"^stages.x.attn_implementation: {requested} {problem}"):
        choose_attention(requested, on_gpu=False, field="stages.x.attn_implementation")


def test_only_flex_pads_to_a_static_width_rounded_to_its_block():
    assert static_width("sdpa", 1000) is None and static_width("flash_attention_2", 1000) is None
    assert static_width("flex_attention", 1000) == 1024
    assert static_width("flex_attention", 2 * FLEX_BLOCK) == 2 * FLEX_BLOCK
    assert flattens_micro_batch("flash_attention_2") and not flattens_micro_batch("flex_attention")


def test_padding_is_a_segment_of_its_own_with_no_target():
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 1]]), "targets": torch.tensor([[6, 7, -100], [9, -100, -100]]),
             "position_ids": torch.tensor([[0, 1, 2], [0, 1, 0]])}
    out = pad_packed_batch(batch, 6, pad_id=1)
    assert out["input_ids"].tolist() == [[5, 6, 7, 1, 1, 1], [8, 9, 1, 1, 1, 1]]
    assert out["targets"][:, 3:].eq(-100).all() and out["targets"][:, :3].equal(batch["targets"])
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 0, 1, 2]]
    assert pad_packed_batch(batch, 3, pad_id=1) is batch
    with pytest.raises(ValueError, match="batch width 3 exceeds the static width 2"):
        pad_packed_batch(batch, 2, pad_id=1)
