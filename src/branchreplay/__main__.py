"""`python -m branchreplay ...` (and `torchrun --nproc_per_node N -m branchreplay train ...`): the command line."""

import sys

from .cli import main

sys.exit(main())
