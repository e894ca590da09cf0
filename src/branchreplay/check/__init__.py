"""Checks above the engine and the training side: `branchreplay verify` (`verify`, `cli`, and `parallel` for N local
processes), and the first-use self-check of a family outside the registry (`self_check`). The references they compare
with are `branchreplay.reference`.
"""
