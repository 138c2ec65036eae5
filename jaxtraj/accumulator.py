"""Accumulate complete steps in rollout order and materialise them.

The joiner's buffers already hold every half in rollout order, slot ``(s, e, t)``.
The accumulator turns a source's slots into resolved steps with
``TrajectoryStep.from_parts`` (elementwise over ``[E, T, B]``) and into the temporal
layout with ``Trajectory.from_steps``; it never inspects the fields itself.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxtraj.joiner import CollectorState
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import Trajectory, TrajectoryStep


def source_steps(plan: TrajectoryPlan, state: CollectorState, s: jax.Array) -> TrajectoryStep:
    """Resolved steps of source ``s`` (traced index), leaves ``[E, T, B, ...]``."""
    take = lambda b: b[s]  # noqa: E731
    return TrajectoryStep.from_parts(
        jax.tree.map(take, state.policy),
        jax.tree.map(take, state.env),
        env_reward_weight=plan.env_reward_weight,
        reward_model_weight=plan.reward_model_weight,
    )


def materialize(plan: TrajectoryPlan, state: CollectorState, s: jax.Array) -> Trajectory:
    """The :class:`Trajectory` of source ``s``'s current training step.

    It does not check completeness; the output strategies do.
    """
    given = None if state.next_obs_given is None else state.next_obs_given[s]
    return Trajectory.from_steps(
        source_steps(plan, state, s),
        jax.tree.map(lambda b: b[s], state.initial),
        next_obs_given=given,
        step_id=state.step[s],
        env_rank=state.sources[s, 0],
        stage_id=state.sources[s, 1],
    )


@dataclasses.dataclass(frozen=True)
class TrajectoryAccumulator:
    """The accumulator's pure functions bound to a plan (hashable, ``jit``-static)."""

    plan: TrajectoryPlan

    def steps(self, state: CollectorState, s: jax.Array) -> TrajectoryStep:
        return source_steps(self.plan, state, s)

    def materialize(self, state: CollectorState, s: jax.Array) -> Trajectory:
        return materialize(self.plan, state, s)
