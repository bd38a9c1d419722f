"""Verifiable rewards: math, code (sandboxed), logic games, instruction following,
reasoning-gym tasks (scored by each family's own grader).

    from verifiers import Reward, verify, verify_batch, get_verifier, register_verifier, VERIFIERS

See verifiers/README.md. This package imports nothing from the rest of the repository.
"""
# domain modules register themselves on import
from . import (
    code_exec,  # noqa: E402,F401
    code_strict,  # noqa: E402,F401
    ifeval,  # noqa: E402,F401
    math_answer,  # noqa: E402,F401
    math_strict,  # noqa: E402,F401
    rgym,  # noqa: E402,F401
    rgym_strict,  # noqa: E402,F401
)
from .api import VerifierPool, VerifierPoolError, shutdown_pool, verify, verify_batch
from .logic import arc, countdown, knights_knaves, maze, strict, sudoku  # noqa: E402,F401
from .registry import VERIFIERS, get_verifier, register_verifier
from .schema import Reward, TaskRow

__all__ = [
    "Reward",
    "TaskRow",
    "VERIFIERS",
    "VerifierPool",
    "VerifierPoolError",
    "get_verifier",
    "register_verifier",
    "shutdown_pool",
    "verify",
    "verify_batch",
]
