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
    """bool (``[S]`` for a stacked state): sources whose step is complete and can flush."""
    return joiner.source_complete(state)


def flush(
    plan: TrajectoryPlan,
    state: CollectorState,
    source_index: jax.Array | int | None = None,
    *,
    assume_complete: bool = False,
) -> tuple[CollectorState, Trajectory]:
    """Flush one source's training step.

    Args:
      plan: the static plan.
      state: the collector state (donate it).
      source_index: index ``s`` of the source in a stacked state; unused otherwise.
      assume_complete: static; the caller has checked completeness (the facade
        does, on the host). On a single-source state the trajectory then takes the
        state's buffers as they are and the state gets fresh ones. Under ``jit`` with
        the state donated, return the trajectory *first* from the jitted function:
        donated buffers go to the first outputs of matching shape, and only then is
        the flush free of a copy.

    Returns:
      ``(state, trajectory)``. If the scope is incomplete (and not assumed complete)
      the state's data is left as it was, ``INCOMPLETE_SCOPE`` is recorded, and the
      trajectory must be discarded (the facade raises instead).
    """
    s = None if not state.stacked else jnp.asarray(source_index, jnp.int32)
    traj = materialize(plan, state, s)
    at = (lambda x: x[s]) if state.stacked else (lambda x: x)
    put = (lambda x, v: x.at[s].set(v)) if state.stacked else (lambda x, v: v)
    if assume_complete and not state.stacked:
        fresh = lambda tree: jax.tree.map(jnp.zeros_like, tree)
        state = state.replace(
            policy=fresh(state.policy),
            env=fresh(state.env),
            initial=fresh(state.initial),
            policy_rows=fresh(state.policy_rows),
            env_rows=fresh(state.env_rows),
            next_obs_given=fresh(state.next_obs_given),
            next_rlt_given=fresh(state.next_rlt_given),
            epochs_flushed=fresh(state.epochs_flushed),
            step=state.step + 1,
        )
        return state, traj
    complete = jnp.asarray(True) if assume_complete else at(ready(state))

    def clear(rows):
        return None if rows is None else put(rows, jnp.where(complete, False, at(rows)))

    state = state.replace(
        policy_rows=clear(state.policy_rows),
        env_rows=clear(state.env_rows),
        next_obs_given=clear(state.next_obs_given),
        next_rlt_given=clear(state.next_rlt_given),
        step=put(state.step, at(state.step) + complete.astype(jnp.int32)),
    )
    key = TrajectoryKey(traj.step_id, -1, traj.env_rank, traj.stage_id, -1)
    code = jnp.where(complete, 0, int(ErrorCode.INCOMPLETE_SCOPE)).astype(jnp.int32)
    return joiner.record_error(state, code, key, s), traj
