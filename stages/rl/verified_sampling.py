"""A model sampled through the rollout engine and its responses scored by the verifiers, done
once for every stage that does it: `eval` (accuracy), `distill` (which samples to keep) and
general_rl's reasoning guard (what RLHF cost reasoning). Their settings are
`stages.rl.settings.GenerationSettings` / `SamplingSettings`.

No torch at module level: a verifier worker imports the stage's entry module, and with it this
one (verifiers/api.py).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stages.common.chat import require_chat_template
from stages.common.contract import StageError, StageJob
from stages.common.hf_io import eos_token_ids_of, load_tokenizer, require_model_dir
from stages.rl.decoding import make_decoder
from stages.rl.settings import GenerationSettings, VerifierSettings
from verifiers import verify_batch


@dataclass(frozen=True)
class ScoredResponse:
    """One response: its row (an index into the rows scored), its sample number, its text
    (`stages.rl.decoding.Decoded`: also n_tokens, ended_by_eos) and the verifier's reward
    (`.score`, `.reason`)."""

    row: int
    sample: int
    text: Any
    reward: Any


def generate_and_score(engine, decode: Callable[[list[int]], Any], rows: Sequence[dict[str, Any]],
                       prompt_ids: Sequence[Sequence[int]], sampling, *, max_new_tokens: int,
                       verifier: VerifierSettings, samples: int = 1, which: Sequence[int] | None = None,
                       uid: str = "{row}/{sample}") -> list[ScoredResponse]:
    """`samples` responses to each row of `which` (default: every row) from `engine` under
    `sampling` (`stages.rl.engines.SamplingParams`), scored by the verifier of each row's
    domain; in row then sample order. `uid` names each request: an engine may seed a request
    by its uid (vLLM does), so a caller keeps the names its results were drawn with."""
    from stages.rl.engines import RolloutRequest  # torch: not at the top (module docstring)

    which = range(len(rows)) if which is None else which
    drawn = [(i, j) for i in which for j in range(samples)]
    requests = [RolloutRequest(uid=uid.format(row=i, sample=j), prompt_ids=list(prompt_ids[i]),
                               max_new_tokens=max_new_tokens) for i, j in drawn]
    texts = [decode(list(u.token_ids)) for u in engine.generate(requests, sampling)]
    rewards = verify_batch([rows[i] for i, _ in drawn], [str(t) for t in texts], num_workers=verifier.verifier_workers,
                           timeout_s=verifier.verifier_timeout_s)
    return [ScoredResponse(i, j, text, reward) for (i, j), text, reward in zip(drawn, texts, rewards)]


class SamplingModel:
    """A model's tokenizer, decoder and rollout engine, in one process (the engine's memory is
    freed by close): what eval scores and distill samples its teacher with. `key` is the config
    key errors name (default `models.<name>`)."""

    def __init__(self, job: StageJob, cfg: GenerationSettings, name: str, ref: str, key: str | None = None):
        import torch
        from transformers.utils import logging as hf_logging

        from stages.common.distributed import resolve_device  # torch: not at the top (module docstring)
        from stages.rl.engines import create_engine  # torch (module docstring)

        where = f"{key or f'models.{name}'} = {ref}:"
        model_dir = require_model_dir(job.fetch(ref), where)
        hf_logging.disable_progress_bar()
        trust = cfg.trust_remote_code
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code=trust, what=where)
        require_chat_template(self.tokenizer, ref)
        self.decode = make_decoder(self.tokenizer, eos_token_ids_of(model_dir, trust_remote_code=trust))
        own = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        device = resolve_device(cfg.rollout.device, "rollout.device", own)
        try:
            self.engine = create_engine(cfg.rollout.engine, str(model_dir), device=device, dtype=cfg.rollout.dtype,
                                        max_batch=cfg.rollout.max_batch,
                                        max_len=cfg.prompt_max_len + cfg.max_new_tokens, seed=cfg.seed,
                                        trust_remote_code=trust, **cfg.rollout.options)
        except (KeyError, ValueError, RuntimeError, FileNotFoundError) as e:
            raise StageError(f"{where} cannot start the {cfg.rollout.engine} engine: {e}") from None

    def generate_and_score(self, cfg: GenerationSettings, rows: Sequence[dict[str, Any]],
                           prompt_ids: Sequence[Sequence[int]], sampling, *, samples: int = 1,
                           which: Sequence[int] | None = None) -> list[ScoredResponse]:
        """`generate_and_score` on this model, with the stage's length cap and verifiers."""
        return generate_and_score(self.engine, self.decode, rows, prompt_ids, sampling,
                                  max_new_tokens=cfg.max_new_tokens, verifier=cfg, samples=samples, which=which)

    def close(self) -> None:
        import torch

        del self.engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
