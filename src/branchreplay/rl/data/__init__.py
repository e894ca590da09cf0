"""What a run trains on: reasoning-gym tasks and users' prompt files (tasks.py, datafiles.py), reward functions
(rewards.py), DPO's preference pairs (preferences.py), and the items a step takes (order.py)."""
