"""Regional compilation of a training model: every decoder layer through torch.compile, in
place (the `compile_layers` setting of the SFT and RL stages).

One decoder layer's code is compiled once and shared by every layer of the model (dynamo
takes the parameters as inputs), so a model compiles in the time of one layer, once per grad
mode. Shapes: by default the first call compiles for its exact shapes and the first call with
another shape recompiles with the changed sizes dynamic (torch's automatic dynamic shapes);
with `dynamic=True` (the RL policy: its learner's micro batches change rows and width with
every call) sizes are symbolic from the first compile. Either way a size of 1 (a one-row micro
batch) is specialised once more; no shape after that compiles again
(tests/stages/common/test_compile_layers.py counts the graphs).

`RING_COMPILE_BACKEND` (environment) names the torch.compile backend of every compile the
project makes (these layers, the fused loss, the torch engine's decode step), `inductor` by
default; `aot_eager` traces the same graphs without code generation, which is what the CPU smoke
of benchmarks/sft_throughput.py and the tests use (inductor's C++ compile of a CPU graph takes
minutes on a small machine).

No torch import at module level: the stage configs import this module for the field."""
from __future__ import annotations

import os
from typing import Any

from stages.common.contract import StageError, auto_setting

BACKEND_ENV = "RING_COMPILE_BACKEND"
DEFAULT_BACKEND = "inductor"


def compile_backend() -> str:
    """The torch.compile backend: `$RING_COMPILE_BACKEND`, else inductor."""
    return os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND


def compile_layers_field() -> Any:
    """The `compile_layers` field of every training stage config (checked with `check_zero_stage`);
    `auto` hashes as False, its default before (stages/common/speed_defaults.py decides it)."""
    return auto_setting(False, description=(
        "torch.compile each decoder layer (regional compilation): fused kernels and far less Python "
        "per step, which bounds a small micro batch's step on a GPU; the first steps compile "
        f"(backend: ${BACKEND_ENV}, default {DEFAULT_BACKEND}). ZeRO 0-2 (ZeRO-3 gathers parameters "
        "in hooks around each layer); auto = on a GPU below ZeRO-3, off on CPU"))


def check_zero_stage(compile_layers: bool | str, zero_stage: int | str) -> None:
    """A config validator's check: compiled layers and ZeRO-3 do not go together (`auto` is
    decided so that they do not)."""
    if compile_layers is True and zero_stage == 3:
        raise ValueError("compile_layers needs zero_stage 0, 1 or 2 (ZeRO-3 gathers each layer's "
                         "parameters in hooks that compiled layers do not run the same way)")


def compile_decoder_layers(lm: Any, model: str, dynamic: bool | None = None) -> None:
    """torch.compile every decoder layer of the causal LM `lm` in place (parameter names, and so
    checkpoints and saved models, stay the same). `model`: the config's model, for the error.
    `dynamic`: torch.compile's; True for inputs whose shape changes with every call (the RL
    learner's micro batches): sizes are symbolic from the first compile."""
    layers = getattr(lm.get_decoder(), "layers", None)
    import torch

    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise StageError(f"model {model}: compile_layers needs the decoder's layers as "
                         f"`.layers` (a ModuleList); {type(lm.get_decoder()).__name__} has none")
    backend = compile_backend()
    try:
        for layer in layers:
            layer.compile(backend=backend, dynamic=dynamic)
    except torch._dynamo.exc.InvalidBackend as e:
        raise StageError(f"compile_layers: ${BACKEND_ENV}={backend!r} is not a torch.compile backend "
                         f"(known: {', '.join(torch._dynamo.list_backends())})") from e
