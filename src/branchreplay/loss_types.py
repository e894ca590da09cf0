"""The loss type names of GRPO and DPO (TRL's `loss_type` values), torch-free so that the run config parses before
torch loads; `losses.py` implements them."""

from __future__ import annotations

import typing
from typing import Literal

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"]
LOSS_TYPES: tuple[str, ...] = typing.get_args(LossType)
DPOLossType = Literal["sigmoid", "hinge", "ipo", "robust", "simpo"]
DPO_LOSS_TYPES: tuple[str, ...] = typing.get_args(DPOLossType)
