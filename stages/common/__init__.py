"""Pieces the training stages share (sft, reward_model, reasoning_rl, general_rl): process
group setup, DeepSpeed setup, checkpoints, Hugging Face model I/O and data-file reading.

No `config.py` here on purpose: stages/registry.py registers every `stages/<pkg>/config.py`
as a stage kind, and this package is not a stage. Stages that import it list
"stages.common" in their StageKind `sources` so their hash tracks this code."""
