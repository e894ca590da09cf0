"""The training side: RL over prefix trees (today GRPO; the modules are named for what they do, not for GRPO alone).

`config` (the run configuration and its one parser), `trainer` (the loop), `evaluation` (held-out score),
`sampling` (rollouts of a group, the prompt prefilled once), `tasks` and `rewards` (reasoning-gym, math-verify,
users' functions), `advantages` (group-relative), `checkpoint` (atomic save and resume), `log` (the run log).
"""
