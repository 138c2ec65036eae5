"""Adding a field for a new algorithm touches the types only (docs/adding-a-field.md).

The worked example: a goal score from a reward model, produced by Env in
``EnvTransition``, resolved in ``TrajectoryStep.from_parts``, laid out by
``Trajectory.from_steps``, and packed into pipeline micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import struct
from helpers import PLAN, B, E, T, all_parts, env_part, policy_part

import jaxtraj


# 1. Add the field to the type that owns it: Env produces it.
@struct.dataclass
class ScoredTransition(jaxtraj.EnvTransition):
    goal_score: Any = None  # [B] float32, the reward model's goal score


# 3. Resolve it in TrajectoryStep.from_parts.
@struct.dataclass
class ScoredStep(jaxtraj.TrajectoryStep):
    goal_score: Any = None

    @classmethod
    def from_parts(cls, policy, env, plan=None):
        return super().from_parts(policy, env, plan).replace(goal_score=env.transition.goal_score)


# 4. Materialise it in Trajectory.from_steps: one entry per chunk, [E, T, B].
@struct.dataclass
class ScoredTrajectory(jaxtraj.Trajectory):
    goal_score: Any = None

    @classmethod
    def from_steps(cls, steps, initial, **kwargs):
        return super().from_steps(steps, initial, **kwargs).replace(goal_score=steps.goal_score)


def score(chunk, epoch, env_rank, step=0):
    return (
        np.float32(1000 * step + 100 * env_rank + 10 * epoch + chunk)
        + np.arange(B, dtype=np.float32) / 10
    )


def scored(part):
    """2. Populate it in Env: split/merge follow the batch dimension by themselves."""
    if isinstance(part, jaxtraj.PolicyPart):
        return part
    k = part.source.key
    tr = part.transition
    goal_score = score(k.chunk_id, k.epoch_id, k.env_rank, k.step_id)
    new = ScoredTransition(
        **{f.name: getattr(tr, f.name) for f in dataclasses.fields(tr)}, goal_score=goal_score
    )
    return part.replace(transition=new)


def test_a_new_field_reaches_the_trajectory_and_the_micro_batches():
    plan = dataclasses.replace(PLAN, step_type=ScoredStep, trajectory_type=ScoredTrajectory)
    parts = [scored(p) for p in all_parts(0) + all_parts(1)]
    c = jaxtraj.TrajectoryCollector(plan, policy_part(0), scored(env_part(0)))
    out = []
    for p in parts:
        for f in p.split([1, B - 1]):  # fragments carry the new field too
            out += c.add(f)
    for _, traj in out:
        assert isinstance(traj, ScoredTrajectory)
        r = int(traj.env_rank)
        for e in range(E):
            for t in range(T):
                np.testing.assert_array_equal(traj.goal_score[e, t], score(t, e, r))

    # 5. Pipeline mode packs it with the other per-chunk fields.
    pipe = dataclasses.replace(plan, mode="pipeline", actor_ranks=2)
    c = jaxtraj.TrajectoryCollector(
        pipe, policy_part(0), scored(env_part(0)), rng=jax.random.PRNGKey(0)
    )
    items = c.add_many(parts)
    assert len(items) == E * 2
    for _, mb in items:
        tag = np.asarray(mb.forward_inputs["tokens"])[..., 0]  # 100 * rank + 10 * epoch + chunk
        row = np.asarray(mb.obs["state"])[..., 0] - tag
        mask = np.asarray(mb.loss_mask)
        np.testing.assert_allclose(
            np.asarray(mb.extras["goal_score"])[mask], (tag + row / 10)[mask], rtol=1e-6
        )
