"""Multi-turn agents: environments and tools (environments.py), the conversation's token bookkeeping
(conversation.py), and a run's agent task: loading, trajectory rewards, metrics and greedy evaluation (task.py)."""
