"""Pieces the stages share: how a stage job runs (entry.py), the process group
(distributed.py), DeepSpeed set-up, checkpoints, Hugging Face model I/O, the one data-file
reader (rows.py) and the one prompt renderer (chat.py). Map: docs/ARCHITECTURE.md.

No `config.py` here on purpose: stages/registry.py takes every package under stages/ that
has one for a stage kind, and this package is not a stage. Stages that import it list
"stages.common" in their StageKind `sources`."""
