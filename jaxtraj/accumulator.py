"""Accumulate complete steps in rollout order and materialise them.

The joiner's buffers already hold every half in rollout order, slot ``(s, e, t)``.
The accumulator turns a source's slots into resolved steps with
``TrajectoryStep.from_parts`` (elementwise over ``[E, T, B]``) and into the temporal
layout with ``Trajectory.from_steps`` (or the plan's subclasses of them); it never
inspects the fields itself.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxtraj.joiner import CollectorState
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import Trajectory, TrajectoryStep


def _take(state: CollectorState, s: jax.Array | None):
    """Select source ``s`` of a stacked state (a copy); a single-source state as is."""
    if state.stacked:
        return lambda tree: jax.tree.map(lambda b: b[s], tree)
    return lambda tree: tree


def source_steps(
    plan: TrajectoryPlan, state: CollectorState, s: jax.Array | None = None
) -> TrajectoryStep:
    """Resolved steps of a source, leaves ``[E, T, B, ...]``.

    ``s`` (traced) selects the source of a stacked state; ignored otherwise.
    """
    take = _take(state, s)
    step_type = plan.step_type or TrajectoryStep
    return step_type.from_parts(take(state.policy), take(state.env), plan)


def materialize(
    plan: TrajectoryPlan, state: CollectorState, s: jax.Array | None = None
) -> Trajectory:
    """The :class:`Trajectory` of a source's current training step.

    ``s`` (traced) selects the source of a stacked state; ignored otherwise. It does
    not check completeness; the output strategies do.
    """
    take = _take(state, s)
    sources = take(state.sources)
    return (plan.trajectory_type or Trajectory).from_steps(
        source_steps(plan, state, s),
        take(state.initial),
        next_obs_given=take(state.next_obs_given),
        next_rlt_given=take(state.next_rlt_given),
        step_id=take(state.step),
        env_rank=sources[0],
        stage_id=sources[1],
    )


@dataclasses.dataclass(frozen=True)
class TrajectoryAccumulator:
    """The accumulator's pure functions bound to a plan (hashable, ``jit``-static)."""

    plan: TrajectoryPlan

    def steps(self, state: CollectorState, s: jax.Array | None = None) -> TrajectoryStep:
        return source_steps(self.plan, state, s)

    def materialize(self, state: CollectorState, s: jax.Array | None = None) -> Trajectory:
        return materialize(self.plan, state, s)
