"""Rollout mode: one ``Trajectory`` per source and training step.

Completion scope: every chunk of every epoch of one source's current training step.
Sources flush independently. A flush materialises the source's trajectory, clears
its coverage (the flushed slots read as empty again: the data buffers are not
cleared, the masks decide) and advances its step.

Under ``jit`` with the state donated, the trajectory takes the state's buffers
without a copy when the caller gives the state other buffers to continue with:
``recycle``, a trajectory the caller has finished with (donated too)::

    flush = jax.jit(jaxtraj.rollout.flush, static_argnums=0, donate_argnums=(1, 3))
    trajectory, state = flush(plan, state)                       # first step: one copy
    ...
    trajectory, state = flush(plan, state, None, old_trajectory)  # zero-copy from then on

Without ``recycle`` the state keeps its buffers and the trajectory is one copy of
them; a trajectory handed out is never written by later collection.

On the CPU, read a trajectory you will recycle with ``np.asarray`` or ``np.array``, not
``jax.device_get``: since jax 0.11 ``device_get`` keeps a NumPy view of each CPU buffer,
and a buffer so viewed is copied when donated, not reused (the result is the same, with
one more copy).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtraj._forwarding import forwarding_jit
from jaxtraj.errors import ErrorCode
from jaxtraj.modes._layout import PerSource
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.state import CollectorState, materialize_running, record_error, source_complete
from jaxtraj.types import Trajectory, TrajectoryKey


def ready(state: CollectorState) -> jax.Array:
    """bool (``[S]`` for a stacked state): sources whose step is complete and can flush."""
    return source_complete(state)


def _data(state: CollectorState) -> list:
    return jax.tree.leaves((state.policy, state.env, state.initial))


def flush(
    plan: TrajectoryPlan,
    state: CollectorState,
    source_index: jax.Array | int | None = None,
    recycle: Trajectory | None = None,
) -> tuple[Trajectory, CollectorState]:
    """Flush one source's training step.

    Args:
      plan: the static plan.
      state: the collector state (donate it).
      source_index: index ``s`` of the source in a stacked state (its trajectory is a
        copy of its slice); unused otherwise.
      recycle: a trajectory of an earlier step that the caller no longer uses
        (donate it), or ``None``. On a single-source state its buffers become the
        state's, so the new trajectory takes the state's buffers without a copy.

    Returns:
      ``(trajectory, state)``. If the scope is incomplete the state's data is left as
      it was, ``INCOMPLETE_SCOPE`` is recorded, and the trajectory must be discarded
      (the facade raises instead).
    """
    s = None if not state.stacked else jnp.asarray(source_index, jnp.int32)
    traj, running = materialize_running(plan, state, s)
    at = (lambda x: x[s]) if state.stacked else (lambda x: x)
    put = (lambda x, v: x.at[s].set(v)) if state.stacked else (lambda x, v: v)
    complete = at(ready(state))

    def clear(rows):
        return None if rows is None else put(rows, jnp.where(complete, False, at(rows)))

    new = state.replace(
        policy_rows=clear(state.policy_rows),
        env_rows=clear(state.env_rows),
        next_obs_given=clear(state.next_obs_given),
        next_rlt_given=clear(state.next_rlt_given),
        step=put(state.step, at(state.step) + complete.astype(jnp.int32)),
        episodes=jax.tree.map(
            lambda old, new: put(old, jnp.where(complete, new, at(old))), state.episodes, running
        ),
    )
    if recycle is not None and not state.stacked:
        new = _recycled(new, traj, recycle)
    key = TrajectoryKey(traj.step_id, -1, traj.env_rank, traj.stage_id, -1)
    code = jnp.where(complete, 0, int(ErrorCode.INCOMPLETE_SCOPE)).astype(jnp.int32)
    return traj, record_error(new, code, key, s)


def _recycled(state: CollectorState, traj: Trajectory, recycle: Trajectory) -> CollectorState:
    """``state`` with every buffer the trajectory passes through replaced by the
    recycled trajectory's leaf in the same place (same shape and dtype)."""
    out_leaves = jax.tree.leaves(traj)
    old_leaves = jax.tree.leaves(recycle)
    if len(old_leaves) != len(out_leaves):
        raise ValueError("recycle: not a trajectory of this plan (its structure differs)")
    where = {id(x): i for i, x in enumerate(out_leaves)}
    data, tree = jax.tree.flatten((state.policy, state.env, state.initial))
    swapped = []
    for b in data:
        i = where.get(id(b))
        if i is None:
            swapped.append(b)
            continue
        old = old_leaves[i]
        if old.shape != b.shape or old.dtype != b.dtype:
            raise ValueError(f"recycle: leaf {i} is {old.shape} {old.dtype}, needs {b.shape} {b.dtype}")
        swapped.append(old)
    policy, env, initial = jax.tree.unflatten(tree, swapped)
    return state.replace(policy=policy, env=env, initial=initial)


@dataclasses.dataclass(frozen=True)
class Rollout(PerSource):
    """Rollout mode in the common form of :mod:`jaxtraj.modes`; scopes are source indices."""

    plan: TrajectoryPlan

    # -- pure ---------------------------------------------------------------------------

    def init(self, state: CollectorState) -> None:
        return None

    def ready(self, state: CollectorState, mode_state: Any = None) -> jax.Array:
        return ready(state)

    def flush(self, state, mode_state=None, scope=None, current_version=0):
        traj, state = flush(self.plan, state, scope)
        return traj, state, mode_state

    # -- host ---------------------------------------------------------------------------

    def end(self, mode_state: Any, state_index: int) -> tuple[list, Any]:
        """Nothing runs between training steps: nothing to hand over."""
        return [], mode_state

    def restored(self, mode_states: list) -> None:
        """After ``load_state_dict``: no host bookkeeping to rebuild."""

    def scopes(self, mirror) -> list[int]:
        return [int(s) for s in np.flatnonzero(mirror.complete().all(axis=1))]

    def state_index(self, scope: int) -> int:
        return scope

    def scope_name(self, scope: int, mirror) -> tuple[int, int]:
        """The facade names a source scope by its ``(env_rank, stage_id)``."""
        return tuple(int(v) for v in mirror.sources[scope])

    def scope_index(self, name: Any, mirror) -> int | None:
        found = mirror.index.get(tuple(int(v) for v in name))
        return found

    def place(self, state: CollectorState) -> CollectorState:
        return state

    def describe(self, scope: int, mirror) -> tuple:
        r, st = mirror.sources[scope]
        return (int(mirror.step[scope]), -1, int(r), int(st), -1)

    def compiled_flush(self, state, mode_state, scope, current_version, *, owned: bool):
        """``owned``: the state's buffers are the caller's to hand over (the facade's
        host staging, renewed every step): no copy. Otherwise donated, trajectory first."""
        fn = _owned_flush(self.plan) if owned else _donated_flush(self.plan)
        traj, state = fn(state)
        return traj, state, mode_state

    def emit(self, items: Trajectory, scope: int, mirror) -> list[tuple[str, Any]]:
        return [(self.plan.queue_key, items)]

    def advance(self, scope: int, mirror) -> list[int]:
        mirror.clear_source(scope)
        return [scope]


@functools.cache
def _owned_flush(plan: TrajectoryPlan):
    return forwarding_jit(lambda st: flush(plan, st))


@functools.cache
def _donated_flush(plan: TrajectoryPlan):
    return jax.jit(lambda st: flush(plan, st), donate_argnums=0)
