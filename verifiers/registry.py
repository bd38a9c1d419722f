"""Registry: ``domain`` name -> verifier function.

A verifier is ``fn(row: TaskRow, text: str) -> Reward`` where ``text`` is the final answer
(the response after the thinking section). Register with ``@register_verifier("name",
"alias", ...)``. ``verify`` (in ``verifiers.api``) does the think-splitting, timing,
timeouts and turns exceptions into score-0 rewards, so verifier functions stay small.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping

from .schema import Reward, TaskRow

VerifierFn = Callable[[TaskRow, str], Reward]


class VerifierRegistry(MutableMapping[str, VerifierFn]):
    def __init__(self) -> None:
        self._fns: dict[str, VerifierFn] = {}

    def __getitem__(self, name: str) -> VerifierFn:
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(f"no verifier registered for domain {name!r}; known: {sorted(self._fns)}") from None

    def __setitem__(self, name: str, fn: VerifierFn) -> None:
        self._fns[name] = fn

    def __delitem__(self, name: str) -> None:
        del self._fns[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"VerifierRegistry({sorted(self._fns)})"


VERIFIERS = VerifierRegistry()
# Heavy packages a domain imports on first use (reasoning_gym: seconds). The worker pool
# (api.py) imports them in its forkserver, before any worker starts, so no row's timeout
# pays for the import (on a loaded machine it outlasted the timeout, and every row scored 0).
WORKER_PRELOAD: list[str] = []


def register_verifier(name: str, *aliases: str) -> Callable[[VerifierFn], VerifierFn]:
    def deco(fn: VerifierFn) -> VerifierFn:
        for key in (name, *aliases):
            VERIFIERS[key] = fn
        return fn

    return deco


def get_verifier(domain: str) -> VerifierFn:
    return VERIFIERS[domain]
