"""A training run: the trainer (trainer.py), a step's updates written once for every algorithm (update.py), atomic
checkpoints (checkpoint.py), the metrics log and summary (log.py), held-out evaluation (evaluation.py), export of a
checkpoint (export.py), the data-parallel ranks and their heartbeats (parallel.py), and how a run stops
(stops.py)."""
