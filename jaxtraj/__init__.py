"""jaxtraj: a JAX-native trajectory collector for embodied reinforcement learning.

Join the two halves of every action chunk by key, accumulate them in fixed-capacity
device buffers, and flush Actor-ready trajectories.
"""

from jaxtraj.accumulator import TrajectoryAccumulator, materialize
from jaxtraj.advantages import (
    discounted_returns,
    gae,
    gae_from_next_values,
    group_advantages,
    normalize_advantages,
)
from jaxtraj.collector import TrajectoryCollector, stack_parts
from jaxtraj.errors import CollectorError, ErrorCode, raise_if_error
from jaxtraj.joiner import (
    ChunkJoiner,
    CollectorState,
    add_env,
    add_envs,
    add_policies,
    add_policy,
    init,
    slot_complete,
    source_complete,
)
from jaxtraj.pipeline import MicroBatches
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.rollout import flush, ready
from jaxtraj.targets import Targets, trajectory_targets
from jaxtraj.types import (
    EnvPart,
    EnvTransition,
    PolicyInput,
    PolicyOutput,
    PolicyPart,
    Trajectory,
    TrajectoryKey,
    TrajectorySource,
    TrajectoryStep,
)

__version__ = "0.1.0"

__all__ = [
    "ChunkJoiner",
    "CollectorError",
    "CollectorState",
    "EnvPart",
    "EnvTransition",
    "ErrorCode",
    "MicroBatches",
    "PolicyInput",
    "PolicyOutput",
    "PolicyPart",
    "Trajectory",
    "TrajectoryAccumulator",
    "TrajectoryCollector",
    "TrajectoryKey",
    "TrajectoryPlan",
    "TrajectorySource",
    "Targets",
    "TrajectoryStep",
    "add_env",
    "add_envs",
    "add_policies",
    "add_policy",
    "discounted_returns",
    "flush",
    "gae",
    "gae_from_next_values",
    "group_advantages",
    "init",
    "materialize",
    "normalize_advantages",
    "raise_if_error",
    "ready",
    "slot_complete",
    "source_complete",
    "stack_parts",
    "trajectory_targets",
]
