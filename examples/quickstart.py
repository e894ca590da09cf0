import torch
from branchreplay import GRPOLoss, Rollout, RolloutTree, replay_backward, replay_logprobs, token_weights
from branchreplay.models import chat_prompt_ids, load_model

model, tokenizer = load_model("smollm2")                       # or a local HF folder, a .gguf file
prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "2 + 3 = ?"}])
completions = [[tokenizer.eos_token_id], [17, 18, tokenizer.eos_token_id]]   # sampled ids (never re-encoded)
masks = [torch.tensor([0] * len(prompt) + [1] * len(c)) for c in completions]
weights = token_weights(masks, "grpo")                         # TRL's normalisation, as per-token weights
rollouts = [Rollout(prompt + c, m, advantages=a, weights=w)
            for c, m, w, a in zip(completions, masks, weights, [1.0, -1.0])]
tree = RolloutTree(rollouts)                                   # shared prompt = one node
out = replay_backward(model, tree, GRPOLoss(beta=0.0), temperature=1.0)   # grads in param.grad
print(out.loss, out.stats.token_ratio, out.logprobs[0][-1])
ref = replay_logprobs(model, tree)                             # forward only, e.g. for old / reference logprobs
