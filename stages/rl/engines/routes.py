"""A rollout's recorded MoE routes as plain data: the experts each MoE layer chose at each
position of prompt + response, [positions, layers, k] (routing replay, stages/rl/routing.py).

Rollouts travel through JSON checkpoints (the scheduler's pools) and pickled broadcasts, so
the array is kept as a dict {"shape", "dtype", "data": base64 of the bytes}: uint8 when every
expert id fits (255 = not recorded), else int16 (-1 = not recorded). `decode_routes` gives an
int16 array with -1 where nothing was recorded.
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np

Routes = dict[str, Any]


def encode_routes(routes: np.ndarray) -> Routes:
    """[positions, layers, k] expert ids (-1 = none) -> the plain-data form."""
    a = np.asarray(routes)
    if a.ndim != 3:
        raise ValueError(f"routes must be [positions, layers, k], got shape {a.shape}")
    small = a.size == 0 or int(a.max()) < 255
    packed = np.where(a < 0, 255, a).astype(np.uint8) if small else a.astype(np.int16)
    return {"shape": list(a.shape), "dtype": packed.dtype.name,
            "data": base64.b64encode(np.ascontiguousarray(packed).tobytes()).decode("ascii")}


def decode_routes(routes: Routes) -> np.ndarray:
    """The plain-data form -> int16 [positions, layers, k], -1 = none."""
    dtype = np.dtype(routes["dtype"])
    a = np.frombuffer(base64.b64decode(routes["data"]), dtype=dtype).reshape(routes["shape"]).astype(np.int16)
    if dtype == np.uint8:
        a[a == 255] = -1
    return a
