"""The RL loop's parts together make a policy better: the torch engine samples, C3PO++ (or the
sync baseline) groups and scores, the learner updates with IcePop, the new weights go back into
the engine; on a reward a tiny random model can learn (the share of response tokens below id
100), the reward rises within 18 steps. This separates "the loop is broken" from "this task or
these settings give RL nothing to learn" (benchmarks/RESULTS.md, "Show it learns")."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stages.rl.engines import create_engine
from stages.rl.engines.protocol import SamplingParams
from stages.rl.learner import Learner, LearnerConfig, TorchBackend
from stages.rl.loss import LossConfig
from stages.rl.prompt_sampler import PromptSampler
from stages.rl.rollout_records import SchedulerConfig
from stages.rl.scheduler import make_scheduler
from tests.stages.rl.tiny_model import EOS, VOCAB, build_model, save_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def low_token_share(rows, texts, groups):
    out = []
    for text in texts:
        ids = [int(t) for t in text.split()] or [VOCAB]
        out.append(SimpleNamespace(score=sum(i < 100 for i in ids) / len(ids), reason=""))
    return out


@pytest.mark.parametrize("scheduler", ["c3po", "sync"])
def test_reward_rises_through_the_rl_loop(scheduler, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model_dir = save_model(build_model(), tmp_path / "policy")
    engine = create_engine("torch", str(model_dir), device="cpu", dtype="float32", max_batch=64, max_len=48,
                           seed=0, eos_token_ids=[EOS])
    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (5,), generator=g).tolist() for _ in range(16)]
    conf = SchedulerConfig(rollouts_per_prompt=8, max_new_tokens=16, prompts_per_step=8, pool_capacity=128,
                           token_budget=8 * 8 * 8, retention_limit=4)
    sched = make_scheduler(scheduler, engine, conf, [{"id": f"r{i}", "domain": "toy"} for i in range(16)], prompts,
                           PromptSampler({"toy": list(range(16))}, None, 0), SamplingParams(temperature=1.0, seed=0),
                           lambda ids: " ".join(map(str, ids)), low_token_share)
    learner = Learner(TorchBackend(policy, torch.optim.AdamW(policy.parameters(), lr=3e-3), 1.0),
                      LearnerConfig(loss=LossConfig(correction="icepop"), pad_id=0))
    rewards = []
    for version in range(18):
        batch = sched.next_batch(version)
        learner.train(batch.samples, version)
        engine.update_weights(policy.named_parameters())
        rewards.append(sum(s.reward for s in batch.samples) / len(batch.samples))
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.45 and last > first + 0.2, rewards
