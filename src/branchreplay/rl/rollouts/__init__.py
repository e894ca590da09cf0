"""A step's rollouts: in-process sampling with one prefill per group (sampling.py), the vLLM client
(vllm_client.py), multi-turn trajectories (trajectories.py), the step's sampled and scored batch (sampler.py,
batch.py), and the vLLM sampler's logprobs against the trainer's (mismatch.py)."""
