"""A training run: one step, its phases in one function (step.py), the run around it (trainer.py), atomic
checkpoints (checkpoint.py), the metrics log and summary (log.py), held-out evaluation (evaluation.py), export of a
checkpoint (export.py), the data-parallel ranks and their heartbeats (parallel.py), and how a run stops
(stops.py)."""
