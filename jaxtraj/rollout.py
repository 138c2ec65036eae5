"""Rollout mode: one ``Trajectory`` per source and training step.

Completion scope: every chunk of every epoch of one source's current training step.
Sources flush independently. A flush materialises the source's trajectory, clears
its coverage (the flushed slots read as empty again) and advances its step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtraj import joiner
from jaxtraj.accumulator import materialize
from jaxtraj.errors import ErrorCode
from jaxtraj.joiner import CollectorState
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import Trajectory, TrajectoryKey


def ready(state: CollectorState) -> jax.Array:
    """``[S]`` bool: sources whose training step is complete and can flush."""
    return joiner.source_complete(state)


def flush(
    plan: TrajectoryPlan, state: CollectorState, source_index: jax.Array
) -> tuple[CollectorState, Trajectory]:
    """Flush one source's training step.

    Args:
      plan: the static plan.
      state: the collector state (donate it).
      source_index: ``int`` index ``s`` into ``state.sources``.

    Returns:
      ``(state, trajectory)``. If the scope is incomplete the state's data is left as
      it was, ``INCOMPLETE_SCOPE`` is recorded and the trajectory must be discarded
      (the facade raises instead).
    """
    s = jnp.asarray(source_index, jnp.int32)
    complete = ready(state)[s]
    traj = materialize(plan, state, s)

    def clear(rows):
        return rows.at[s].set(jnp.where(complete, False, rows[s]))

    state = state.replace(
        policy_rows=clear(state.policy_rows),
        env_rows=clear(state.env_rows),
        step=state.step.at[s].add(complete.astype(jnp.int32)),
    )
    if state.next_obs_given is not None:
        state = state.replace(next_obs_given=clear(state.next_obs_given))
    key = TrajectoryKey(traj.step_id, -1, traj.env_rank, traj.stage_id, -1)
    code = jnp.where(complete, 0, int(ErrorCode.INCOMPLETE_SCOPE)).astype(jnp.int32)
    return joiner.record_error(state, code, key), traj
