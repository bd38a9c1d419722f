"""Which ranks of an RL stage train and which generate (`rollout.gpus`, settings.py).

    colocated (default)   every rank runs a trainer (DeepSpeed, one data-parallel world) and
                          a rollout engine on the same GPU; the engine sleeps (releases its KV
                          cache, optionally its weights) while its rank trains
    split (gpus: k)       ranks 0 .. N-k-1 train (DeepSpeed over them only), ranks N-k .. N-1
                          only generate; each role has a default process world of its own and
                          the roles talk over standalone groups (stages/common/distributed.py)

Tensor parallelism (`rollout.options.tensor_parallel_size: t`, vLLM): the generating ranks form
groups of t consecutive ranks, and the first rank of each group runs one engine on the group's t
GPUs (its processes are vLLM's workers there); the other ranks of a group run no engine (they
still train when colocated). `engines` are the groups' first ranks, `generators` all of them.

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
    engines: range     # global ranks that run a rollout engine (the first of each tensor-parallel group)
    tp: int = 1        # GPUs (ranks) per engine: engine rank r's engine runs on the GPUs of ranks r .. r+tp-1

    @classmethod
    def of(cls, cfg: RLConfig, rank: int, world: int) -> "Placement":
        """The placement of `cfg` on a launch of `world` ranks; the user's mistakes as StageError."""
        k = cfg.rollout.gpus
        if k is not None and k >= world:
            raise StageError(f"rollout.gpus is {k} but the stage runs on {world} rank(s): split placement "
                             f"needs at least one rank left to train (rollout.gpus <= {world - 1}), or unset "
                             "rollout.gpus to generate on every rank (colocated)")
        generators = range(world - k, world) if k is not None else range(world)
        trainers = range(world - k) if k is not None else range(world)
        tp = cfg.rollout.options.get("tensor_parallel_size", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or len(generators) % tp:
            raise StageError(f"rollout.options.tensor_parallel_size is {tp!r}: it must be a positive integer that "
                             f"divides the {len(generators)} generating rank(s) (each engine takes that many GPUs; "
                             f"{'rollout.gpus' if k is not None else 'the stage ranks, colocated'})")
        engines = range(generators.start, generators.stop, tp)
        if len(engines) > 1 and cfg.rollout.device.startswith("cuda:"):
            raise StageError(f"rollout.device {cfg.rollout.device!r} puts all {len(engines)} engines on one GPU; "
                             "use rollout.device: auto (each engine on its rank's own GPU)")
        per_engine = cfg.pool_capacity // len(engines)
        if cfg.scheduler == "c3po" and per_engine < cfg.rollouts_per_prompt:
            raise StageError(f"c3po.pool_capacity ({cfg.pool_capacity}) is shared by {len(engines)} engines: each "
                             f"gets {per_engine}, less than one GRPO group (rollouts_per_prompt = "
                             f"{cfg.rollouts_per_prompt}); raise it to at least "
                             f"{len(engines) * cfg.rollouts_per_prompt}")
        return cls(rank, world, trainers, engines, tp)

    @property
    def generators(self) -> range:
        """Global ranks whose GPUs generate: every engine's tensor-parallel group."""
        return range(self.engines.start, self.engines.start + len(self.engines) * self.tp)

    @property
    def split(self) -> bool:
        return self.trainers != self.generators

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
        tp = f", {self.tp} GPUs each (tensor parallel)" if self.tp > 1 else ""
        if self.split:
            return f"split: ranks {self.trainers.start}-{self.trainers.stop - 1} train, " \
                   f"{self.generators.start}-{self.generators.stop - 1} generate" + \
                   (f" ({len(self.engines)} engine{'s' * (len(self.engines) > 1)}{tp})" if tp else "")
        n = len(self.engines)
        return f"colocated: {n} engine{'s' * (n > 1)}{tp}"
