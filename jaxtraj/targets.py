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
      rewards: the chunks' training rewards (``EnvTransition.chunk_rewards``: the owned
        actions' rewards summed or discounted with ``plan.action_gamma``, plus the
        truncation bootstrap).
      dones: ``[E, T+1, B]`` chunk-level dones (any action of the chunk done).
      valid: rows that carry a real sample: all of them with ``auto_reset``;
        otherwise rows before the environment's first done of the epoch.
      action_mask: ``[E, T, B, K]`` the actions each valid chunk's decision owns and
        that ran (mask per-action log-probabilities with it); ``None`` where every
        field is chunk-level.
    """

    advantages: jax.Array
    returns: jax.Array
    rewards: jax.Array
    dones: jax.Array
    valid: jax.Array
    action_mask: jax.Array | None = None


def chunk_level(
    traj: Trajectory, plan: TrajectoryPlan | None = None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(rewards [E, T, B], dones [E, T+1, B], values [E, T+1, B] or None)``.

    A chunk's reward is ``EnvTransition.chunk_rewards`` of its rewards and flags with the
    plan's ``gamma``, ``action_gamma`` and ``truncation_bootstrap``: the actions the
    chunk's decision owns (up to and including its first episode end, and that ran),
    summed or discounted inside the chunk, plus ``gamma * action_gamma**(k + 1 - K) *
    V(final obs)`` where a truncation at action ``k`` ended it. A chunk is done if any of
    its actions is. Values shaped ``[..., 1]`` are squeezed.
    """
    plan = plan if plan is not None else TrajectoryPlan(num_chunks=1)
    final = traj.final_values
    if final is not None and final.ndim == 4:
        final = final[..., 0]
    rewards = traj.transition().chunk_rewards(
        traj.rewards,
        final,
        gamma=plan.gamma,
        action_gamma=plan.action_gamma,
        bootstrap=plan.truncation_bootstrap,
        rows_ndim=3,
    )
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
    rewards, dones, values = chunk_level(traj, plan)
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
    mask = traj.action_mask
    if mask is not None:
        mask = mask & valid[..., None]
    return Targets(
        advantages=swap(a), returns=swap(r), rewards=rewards, dones=dones, valid=valid,
        action_mask=mask,
    )
