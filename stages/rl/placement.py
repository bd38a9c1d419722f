"""Which ranks of an RL stage train and which generate (`rollout.gpus`, settings.py).

    colocated (default)   every rank runs a trainer (DeepSpeed, one data-parallel world) and
                          a rollout engine on the same GPU; the engine sleeps (releases its KV
                          cache, optionally its weights) while its rank trains
    split (gpus: k)       ranks 0 .. N-k-1 train (DeepSpeed over them only), ranks N-k .. N-1
                          only generate; each role has a default process world of its own and
                          the roles talk over standalone groups (stages/common/distributed.py)

Rank 0 always trains: it logs, checkpoints the global state and writes the outputs. Engine 0
(the first engine rank) holds the reward function and assembles each step's batch.
"""
from __future__ import annotations

from dataclasses import dataclass

from stages.common.contract import StageError
from stages.rl.settings import RLConfig


@dataclass(frozen=True)
class Placement:
    rank: int          # this process's global rank
    world: int         # ranks of the launch
    trainers: range    # global ranks that train
    engines: range     # global ranks that run a rollout engine

    @classmethod
    def of(cls, cfg: RLConfig, rank: int, world: int) -> "Placement":
        """The placement of `cfg` on a launch of `world` ranks; the user's mistakes as StageError."""
        k = cfg.rollout.gpus
        if k is not None and k >= world:
            raise StageError(f"rollout.gpus is {k} but the stage runs on {world} rank(s): split placement "
                             f"needs at least one rank left to train (rollout.gpus <= {world - 1}), or unset "
                             "rollout.gpus to generate on every rank (colocated)")
        engines = range(world - k, world) if k is not None else range(world)
        trainers = range(world - k) if k is not None else range(world)
        if len(engines) > 1 and cfg.rollout.device.startswith("cuda:"):
            raise StageError(f"rollout.device {cfg.rollout.device!r} puts all {len(engines)} engines on one GPU; "
                             "use rollout.device: auto (each engine on its rank's own GPU)")
        per_engine = cfg.pool_capacity // len(engines)
        if cfg.scheduler == "c3po" and per_engine < cfg.rollouts_per_prompt:
            raise StageError(f"c3po.pool_capacity ({cfg.pool_capacity}) is shared by {len(engines)} engines: each "
                             f"gets {per_engine}, less than one GRPO group (rollouts_per_prompt = "
                             f"{cfg.rollouts_per_prompt}); raise it to at least "
                             f"{len(engines) * cfg.rollouts_per_prompt}")
        return cls(rank, world, trainers, engines)

    @property
    def split(self) -> bool:
        return self.trainers != self.engines

    @property
    def kind(self) -> str:
        return "split" if self.split else "colocated"

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainers

    @property
    def is_engine(self) -> bool:
        return self.rank in self.engines

    @property
    def engine0(self) -> int:
        """Global rank of the first engine: it holds the reward and assembles each batch."""
        return self.engines.start

    @property
    def describe(self) -> str:
        """For the checkpoint fingerprint and the log: a checkpoint resumes only on the same placement."""
        if self.split:
            return f"split: ranks {self.trainers.start}-{self.trainers.stop - 1} train, " \
                   f"{self.engines.start}-{self.engines.stop - 1} generate"
        n = len(self.engines)
        return f"colocated: {n} engine{'s' * (n > 1)}"
