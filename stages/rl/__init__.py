"""The RL machinery both RL stages (reasoning_rl, general_rl) run on: not a stage kind itself
(no config.py). A stage plugs an `RLSpec` (spec.py) into the one `RLTrainer` (trainer.py).

    settings.py       RLConfig: the settings every RL stage shares (pydantic, no torch)
    spec.py           RLSpec / RLContext / RLHooks: what a stage plugs in
    trainer.py        RLTrainer: set-up, the loop, checkpoints and resume, outputs
    prompts.py        PromptSet, render_prompts: the prompts a stage hands the trainer
    placement.py      which ranks train and which generate: colocated, or split (rollout.gpus)
    rollouts.py       who generates: DataParallelRollouts (an engine + scheduler shard per engine rank)
    weight_sync.py    how weights reach the engines: gathered into each, or broadcast over NCCL
    policy.py         the policy under DeepSpeed, DeepSpeedBackend, the learner's set-up
    learner.py        one update: pi_train(theta_old), then the loss, micro-batched
    loss.py           GRPO advantages, the IcePop / TIS / none corrections, mismatch stats
    scheduler.py      C3PO++ and the sync baseline: pools, groups, rewards, advantages
    prompt_sampler.py which prompt a new GRPO group gets
    decoding.py       responses as text for the rewards (Decoded)
    verified_sampling.py  a model sampled and its responses verified, outside the trainer
                      (eval, distill, general_rl's reasoning guard): SamplingModel, generate_and_score
    metrics.py        per-step metrics, sample rollouts, the stage summary
    engines/          the rollout engines behind one protocol and one factory
"""
