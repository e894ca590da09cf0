"""Checks against the independent reference: the naive per-rollout computation (`reference`), `branchreplay
verify` (`verify`), the first-use check of an unregistered family (`self_check`), the scoped float64 numerics of
exactness checks (`numerics`), and the synthetic tree shapes they run on (`shapes`).
"""
