"""Run by test_checkpoint.py in a fresh process: restore a checkpoint, add the rest of
the step, flush, and save the trajectory's leaves (argv: checkpoint, output .npz)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from helpers import PLAN, env_part, policy_part  # noqa: E402
from test_checkpoint import rest_of_step  # noqa: E402

from jaxtraj import checkpoint  # noqa: E402

collector = checkpoint.restore(sys.argv[1], PLAN, policy_part(0), env_part(0))
out = []
for part in rest_of_step():
    out += collector.add(part)
assert len(out) == 1, out
np.savez(sys.argv[2], *[np.asarray(x) for x in jax.tree.leaves(out[0][1])])
