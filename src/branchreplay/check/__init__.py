"""Checks above the engine and the training side: `branchreplay verify` (`verify`, `cli`, and `parallel` for N local
processes). The references they compare with are `branchreplay.reference`; the first-use self-check of a family
outside the registry is `engine/self_check.py`, which the trainer and the TRL drop-ins run too.
"""
