"""Which prompt a new GRPO group gets: `PromptSampler` draws a group of prompts (a domain for
reasoning RL, a prompt source for general RL) by weight, then the next row of that group's
shuffled order. Deterministic from the seed; its position is a Stateful (checkpointed with
the scheduler)."""
from __future__ import annotations

import random
from typing import Any, Sequence


class PromptSampler:
    """Draws row indices: a domain by weight, then the next row of that domain's shuffled
    order (reshuffled every epoch of the domain). Deterministic from `seed`; resumable."""

    def __init__(self, domain_rows: dict[str, Sequence[int]], weights: dict[str, float] | None = None,
                 seed: int = 0):
        if weights is None:
            weights = {d: float(len(rows)) for d, rows in domain_rows.items()}
        unknown = sorted(set(weights) - set(domain_rows))
        if unknown:
            raise ValueError(f"domain_weights name domains with no rows in the data: {unknown} "
                             f"(domains in the data: {sorted(domain_rows)})")
        self.domains = sorted(d for d in domain_rows if weights.get(d, 0.0) > 0 and domain_rows[d])
        if not self.domains:
            raise ValueError("no domain has both rows and a positive weight")
        self.weights = [float(weights[d]) for d in self.domains]
        self.rows = {d: list(domain_rows[d]) for d in self.domains}
        self.seed = seed
        self._rng = random.Random(f"sampler/{seed}")
        self._pos = {d: [0, 0] for d in self.domains}  # epoch, index
        self._orders: dict[tuple[str, int], list[int]] = {}

    def _order(self, domain: str, epoch: int) -> list[int]:
        key = (domain, epoch)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] != domain}
            order = list(self.rows[domain])
            random.Random(f"order/{self.seed}/{domain}/{epoch}").shuffle(order)
            self._orders[key] = order
        return self._orders[key]

    def next(self) -> int:
        d = self._rng.choices(self.domains, weights=self.weights)[0]
        epoch, i = self._pos[d]
        row = self._order(d, epoch)[i]
        self._pos[d] = [epoch + 1, 0] if i + 1 == len(self.rows[d]) else [epoch, i + 1]
        return row

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "pos": {d: list(p) for d, p in self._pos.items()},
                "domains": self.domains, "sizes": {d: len(r) for d, r in self.rows.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sizes = {d: len(r) for d, r in self.rows.items()}
        if state["domains"] != self.domains or state["sizes"] != sizes:
            raise ValueError(f"checkpointed sampler was over domains {state['sizes']}, the data now "
                             f"gives {sizes}: resume needs the same RL data")
        v, internal, gauss = state["rng"]
        self._rng.setstate((v, tuple(internal), gauss))
        self._pos = {d: list(p) for d, p in state["pos"].items()}
