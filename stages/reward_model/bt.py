"""The Bradley-Terry pairwise loss and pairwise accuracy.

Model: P(a preferred over b) = sigmoid(r_a - r_b). With y = P(chosen preferred) in the data
(1 for an ordinary pair, 1/2 for a tie kept with `ties: half`), the loss of a pair is the
cross-entropy

    l = -[ y * log sigmoid(d) + (1 - y) * log sigmoid(-d) ],   d = r_chosen - r_rejected

(= -log sigmoid(d) when y = 1). For y = 1/2 it is minimal at d = 0: a tie pulls the two
scores together. Accuracy is over decisive pairs (y != 1/2): 1 if d > 0, 1/2 if d == 0
(a model that scores everything the same is at chance, not at 0), else 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, label: torch.Tensor | None = None,
                       reduction: str = "mean") -> torch.Tensor:
    """Per-pair BT cross-entropy, reduced by "mean" | "sum" | "none"."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} differ in shape")
    d = chosen.float() - rejected.float()
    if label is None:
        loss = -F.logsigmoid(d)
    else:
        y = label.to(d.dtype)
        loss = -(y * F.logsigmoid(d) + (1 - y) * F.logsigmoid(-d))
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be mean, sum or none, not {reduction!r}")


@dataclass
class PairwiseCounts:
    """Sums over pairs (add across micro-batches and ranks), `finalize` for the means."""

    pairs: float = 0.0
    loss_sum: float = 0.0
    decisive: float = 0.0
    correct: float = 0.0
    margin_sum: float = 0.0     # sum of d over decisive pairs
    chosen_sum: float = 0.0
    rejected_sum: float = 0.0

    def add(self, chosen: torch.Tensor, rejected: torch.Tensor, label: torch.Tensor) -> None:
        with torch.no_grad():
            d = (chosen.float() - rejected.float()).double()
            y = label.double()
            self.pairs += d.numel()
            self.loss_sum += float(bradley_terry_loss(chosen, rejected, label, "sum"))
            dec = y != 0.5
            self.decisive += float(dec.sum())
            self.correct += float(((d > 0).double() + 0.5 * (d == 0).double())[dec].sum())
            self.margin_sum += float(d[dec].sum())
            self.chosen_sum += float(chosen.double().sum())
            self.rejected_sum += float(rejected.double().sum())

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.pairs, self.loss_sum, self.decisive, self.correct, self.margin_sum,
                             self.chosen_sum, self.rejected_sum], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "PairwiseCounts":
        return cls(*[float(x) for x in t.tolist()])

    def finalize(self) -> dict[str, float]:
        n, k = max(self.pairs, 1.0), max(self.decisive, 1.0)
        return {"loss": self.loss_sum / n, "accuracy": self.correct / k if self.decisive else float("nan"),
                "margin": self.margin_sum / k, "reward_chosen": self.chosen_sum / n,
                "reward_rejected": self.rejected_sum / n, "pairs": self.pairs}


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor, label: torch.Tensor | None = None) -> float:
    c = PairwiseCounts()
    c.add(chosen, rejected, label if label is not None else torch.ones_like(chosen))
    return c.finalize()["accuracy"]
