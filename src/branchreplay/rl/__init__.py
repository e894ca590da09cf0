"""The training side: RL over prefix trees, one loop for every algorithm.

    policy.py     the model as the engine runs it (temperature, engine section, method, family check, data
                  parallelism, mixed precision, its optimizer): what the algorithms call
    shards.py     a step's trees over the ranks, and every rollout's values on every rank
    algorithms/   one part per algorithm (grpo, rloo, reinforce_pp, ppo, dpo), chosen by name; the estimators' math,
                  the sampler's logprobs against the trainer's
    rollouts/     a step's batch: sampled (in-process by `decode`, or by vLLM) and scored, multi-turn trajectories,
                  the sampler one step ahead
    agent/        multi-turn environments, the conversation's token bookkeeping, agent metrics and evaluation
    data/         tasks, users' datasets, reward functions, preference pairs, the step's prompt order
    config/       the run configuration (torch-free): sections, TRL's names, the parser of train and eval
    run/          the trainer, the updates loop, checkpoints, the metrics log, evaluation, export, ranks
    cli.py        train, eval, export, vllm-serve
"""
