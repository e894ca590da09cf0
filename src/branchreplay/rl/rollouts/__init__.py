"""A step's rollouts: the step's sampled and scored batch (`sampler`, `batch`), multi-turn trajectories
(`trajectories`), the sampler one step ahead in its own process (`ahead`), and the vLLM client and server (`vllm/`).
In-process generation itself is `branchreplay.decode`."""
