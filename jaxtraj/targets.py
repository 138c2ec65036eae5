"""Training targets from a ``Trajectory``: chunk-level rewards and dones, advantages,
returns and the validity mask; the one path shared by rollout mode (the Actor calls
:func:`trajectory_targets`) and pipeline mode (the flush calls it), so both give the
same numbers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxtraj import advantages as adv_lib
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import Trajectory


@struct.dataclass
class Targets:
    """Per-chunk training targets, leaves ``[E, T, B]``.

    Attributes:
      advantages: GAE advantages (critic-free: discounted returns).
      returns: ``advantages + values`` (critic-free: discounted returns).
      rewards: chunk-level rewards (action-level rewards summed over the chunk, or
        discounted inside it with ``plan.action_gamma``).
      dones: ``[E, T+1, B]`` chunk-level dones (any action of the chunk done).
      valid: rows that carry a real sample: all of them with ``auto_reset``;
        otherwise rows before the environment's first done of the epoch.
    """

    advantages: jax.Array
    returns: jax.Array
    rewards: jax.Array
    dones: jax.Array
    valid: jax.Array


def chunk_level(
    traj: Trajectory, action_gamma: float = 1.0
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(rewards [E, T, B], dones [E, T+1, B], values [E, T+1, B] or None)``.

    Action-level rewards ``[E, T, B, K]`` are combined over the chunk as
    ``r_t = sum_k action_gamma**k r_{t,k}`` (``1.0``: summed); a chunk is done if any
    of its actions is (an auto-reset inside the chunk ends the episode there). Values
    shaped ``[..., 1]`` are squeezed.
    """
    rewards = traj.rewards
    if rewards.ndim == 4:
        if action_gamma != 1.0:
            k = rewards.shape[-1]
            rewards = rewards * (action_gamma ** jnp.arange(k, dtype=rewards.dtype)).reshape(
                1, 1, 1, k
            )
        rewards = rewards.sum(axis=-1)
    dones = traj.dones
    if dones.ndim == 4:
        dones = dones.any(axis=-1)
    values = traj.prev_values
    if values is not None and values.ndim == 4:
        values = values[..., 0]
    return rewards, dones, values


def trajectory_targets(
    plan: TrajectoryPlan, traj: Trajectory, current_version: Any = None
) -> Targets:
    """Advantages and returns of every epoch of a trajectory.

    Each epoch is its own recurrence over ``T`` chunks, bootstrapped by its
    ``prev_values[:, T]``. With ``plan.advantage == "gae"`` and values present:
    ``jaxtraj.gae``; otherwise the critic-free discounted returns.

    Args:
      current_version: the policy version now training. With ``plan.max_staleness``
        set, rows whose oldest action came from a version more than that many
        versions older are not ``valid`` (masked out of the loss and normalisation).
    """
    rewards, dones, values = chunk_level(traj, plan.action_gamma)
    swap = lambda x: jnp.swapaxes(x, 0, 1)  # [E, T, B] -> [T, E, B]: time-major, epochs batched
    if plan.advantage == "gae" and values is not None:
        a, r = adv_lib.gae(
            swap(rewards), swap(values), swap(dones), gamma=plan.gamma, lam=plan.gae_lambda
        )
    else:
        r = adv_lib.discounted_returns(swap(rewards), swap(dones), gamma=plan.gamma)
        a = r
    if plan.auto_reset:
        valid = jnp.ones(rewards.shape, bool)
    else:  # after an episode ends without reset, the environment's rows are padding
        valid = ~jnp.cumsum(dones[:, :-1], axis=1, dtype=jnp.int32).astype(bool)
    if plan.max_staleness >= 0 and traj.versions is not None and current_version is not None:
        staleness = traj.staleness(current_version)
        staleness = staleness.reshape(staleness.shape[:3] + (-1,)).max(axis=-1)
        valid = valid & (staleness <= plan.max_staleness)
    return Targets(advantages=swap(a), returns=swap(r), rewards=rewards, dones=dones, valid=valid)
