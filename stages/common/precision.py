"""The training stages' `precision` setting: its help text and how `auto` resolves. No torch
here: the stage configs that describe the setting are imported by every recipe validation."""
from __future__ import annotations

PRECISION_HELP = ("auto = decided before launch (stages/common/speed_defaults.py): bf16-mixed on a GPU at ZeRO-0, "
                  "bf16 at ZeRO 1-3, fp32 on CPU; bf16 = DeepSpeed's bf16 mode (bf16 weights, fp32 "
                  "master copies kept by its optimizer wrapper); bf16-mixed = fp32 weights and optimizer, "
                  "bf16 compute under torch.autocast (DeepSpeed's torch_autocast mode); fp32")


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """The configured precision with `auto` decided: bf16 on a GPU, fp32 otherwise."""
    if precision == "auto":
        return "bf16" if on_gpu else "fp32"
    return precision
