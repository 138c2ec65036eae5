"""The collector's state: fixed-capacity buffers, coverage masks and the error record.

A state holds one source: buffers ``[E, T, B, ...]`` (epochs, chunks, rows) and a
per-row coverage mask for each half, so a slot is complete when both halves cover
all ``B`` rows, whatever the arrival order or fragmentation. Several sources are a
*stacked* state, every leaf with a leading source axis ``[S, ...]``: what
``jax.vmap`` over single-source states gives, and what :func:`init` returns for a
plan with several sources.

Completeness is decided by the masks alone: data buffers are never cleared, and a
slot's data is only read once its masks say both halves arrived.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxtraj.checks import check_reward_assign
from jaxtraj.episode_stats import RunningEpisodes, episode_stats, init_running
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import (
    EnvPart,
    EnvTransition,
    PolicyPart,
    Trajectory,
    TrajectoryStep,
    chunk_size,
    model_flags,
    rlt_features,
)

PyTree = Any


@struct.dataclass
class CollectorState:
    """The collector's state for one source (or, stacked, a leading ``[S]`` on every leaf).

    Attributes:
      policy: ``PolicyPart`` payload (``source=None``), leaves ``[E, T, B, ...]``.
      env: ``EnvPart`` payload: ``transition``, ``next_rlt_obs`` as in the example,
        ``final_values`` when values are used, ``next_obs`` with
        ``collect_transitions``; leaves ``[E, T, B, ...]``.
      initial: chunk zero's boundary flags, leaves ``[E, B, ...]``.
      policy_rows, env_rows: ``[E, T, B]`` bool, rows received per half.
      next_obs_given: ``[E, T, B]`` bool, rows with an explicit ``next_obs``
        (``collect_transitions`` only).
      next_rlt_given: ``[E, T, B]`` bool, rows with an explicit ``next_rlt_obs``
        (``enable_rlt`` only).
      sources: ``[2]`` int32, the ``(env_rank, stage_id)`` this state holds.
      step: int32, the source's current training step.
      errors: ``[7]`` int32 (``[S, 7]`` stacked), the first rejection under ``jit``:
        its code, how many parts were rejected, and its key (one buffer, which every
        insert passes through; :attr:`error_code`, :attr:`error_count` and
        :attr:`error_key` read it).
      episodes: each environment's running episode (``RunningEpisodes``, ``[B]``):
        the sums that the episode statistics of the next flush continue from.
    """

    policy: PyTree
    env: PyTree
    initial: EnvTransition
    policy_rows: jax.Array
    env_rows: jax.Array
    next_obs_given: jax.Array | None
    next_rlt_given: jax.Array | None
    sources: jax.Array
    step: jax.Array
    errors: jax.Array
    episodes: RunningEpisodes

    @property
    def error_code(self) -> jax.Array:
        """int32 (``[S]`` stacked): the first rejection's :class:`ErrorCode`, ``0`` if none."""
        return self.errors[..., 0]

    @property
    def error_count(self) -> jax.Array:
        """int32 (``[S]`` stacked): how many parts were rejected."""
        return self.errors[..., 1]

    @property
    def error_key(self) -> jax.Array:
        """int32 ``[5]`` (``[S, 5]`` stacked): the first rejected part's key."""
        return self.errors[..., 2:]

    @property
    def stacked(self) -> bool:
        """Whether every leaf has a leading source axis."""
        return self.sources.ndim == 2

    @property
    def lead(self) -> int:
        """Leading axes before the rows axis of the slot buffers (``[S,] E, T``)."""
        return self.policy_rows.ndim - 1

    @property
    def actions_per_chunk(self) -> int:
        """``K``, from the action chunk (see :func:`jaxtraj.types.chunk_size`)."""
        return chunk_size(self.policy.output.actions, self.env.transition, self.lead + 1)


def dtype_of(x: Any) -> np.dtype:
    """The dtype a buffer holds for an example leaf (canonicalised: no silent x64)."""
    return jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))


def _alloc(example: PyTree, lead: tuple[int, ...]) -> PyTree:
    def zeros(x):
        return jnp.zeros(lead + tuple(np.shape(x)[1:]), dtype_of(x))

    return jax.tree.map(zeros, example)


def env_layout(plan: TrajectoryPlan, policy_example: PolicyPart, env_example: EnvPart) -> EnvPart:
    """The env payload the buffers hold, built from the examples."""
    final = env_example.final_values
    if final is None:
        final = policy_example.output.prev_values
    next_obs = None
    if plan.collect_transitions:
        next_obs = env_example.next_obs if env_example.next_obs is not None else policy_example.obs
    next_rlt = None
    if plan.enable_rlt:  # the compact next-state features: z_rl, proprio, ref_chunk only
        next_rlt = env_example.next_rlt_obs
        if next_rlt is None:
            next_rlt = rlt_features(policy_example.output.forward_inputs)
    # Per-action observations: dataset frames need them (lerobot mode, a frame per
    # action); elsewhere they
    # cost K observation buffers for nothing, and are ignored.
    per_action = plan.mode == "lerobot" and plan.lerobot_frame == "action"
    action_obs = env_example.action_obs if per_action else None
    return EnvPart(
        source=None,
        transition=env_example.transition,
        next_obs=next_obs,
        initial_transition=None,
        final_values=final,
        next_rlt_obs=next_rlt,
        action_obs=action_obs,
    )


def _init_one(plan, policy_example, env_example, source, step_id) -> CollectorState:
    E, T, B = plan.num_epochs, plan.num_chunks, plan.batch_size
    return CollectorState(
        policy=_alloc(policy_example.replace(source=None), (E, T, B)),
        env=_alloc(env_layout(plan, policy_example, env_example), (E, T, B)),
        initial=_alloc(env_example.transition.boundary(), (E, B)),
        policy_rows=jnp.zeros((E, T, B), bool),
        env_rows=jnp.zeros((E, T, B), bool),
        next_obs_given=jnp.zeros((E, T, B), bool) if plan.collect_transitions else None,
        next_rlt_given=jnp.zeros((E, T, B), bool) if plan.enable_rlt else None,
        sources=jnp.asarray(source, jnp.int32),
        step=jnp.asarray(step_id, jnp.int32),
        errors=jnp.zeros((7,), jnp.int32),
        episodes=init_running(B),
    )


def init(
    plan: TrajectoryPlan,
    policy_example: PolicyPart,
    env_example: EnvPart,
    *,
    sources: Any = None,
    step_id: int = 0,
) -> CollectorState:
    """Allocate a collector state from the plan and one example of each half.

    Only the examples' structure, trailing shapes and dtypes are used (not their row
    count or values). Works under ``jax.eval_shape`` and ``jax.vmap``.

    Args:
      plan: the static configuration.
      policy_example: any ``PolicyPart`` of the run.
      env_example: any ``EnvPart`` of the run.
      sources: ``[2]`` ``(env_rank, stage_id)`` for a single-source state, or
        ``[S, 2]`` for a stacked one. Default: the plan's sources, stacked when there
        are several, ``(0, 0)`` alone otherwise.
      step_id: the first training step.

    Returns:
      A :class:`CollectorState` with nothing received.

    Raises:
      CollectorError: the examples disagree on ``K`` (action chunk against
        action-level rewards or flags).
    """
    if sources is None:
        sources = plan.default_sources()
        sources = sources[0] if len(sources) == 1 else sources
    sources = jnp.asarray(sources, jnp.int32)
    chunk_size(policy_example.output.actions, env_example.transition, 1)  # K agrees
    check_reward_assign(env_example.transition)  # a delayed score needs its score
    flags = policy_example.output.intervene_flags
    if flags is not None:  # model-side flags fit the action chunk (named if not)
        model_flags(policy_example.output.actions, flags, env_example.transition)
    if sources.ndim == 1:
        return _init_one(plan, policy_example, env_example, sources, step_id)
    one = lambda src: _init_one(plan, policy_example, env_example, src, step_id)
    return jax.vmap(one)(sources)


def _key_vector(key) -> jax.Array:
    return jnp.stack([jnp.asarray(k, jnp.int32) for k in key.fields()])


def record_error(state: CollectorState, code: jax.Array, key, s: Any = None) -> CollectorState:
    """Record ``code`` (if non-zero) for ``key``: the first error wins; all are counted.

    ``s`` is the source index of a stacked state.
    """
    at = (lambda x: x[s]) if s is not None else (lambda x: x)
    put = (lambda x, v: x.at[s].set(v)) if s is not None else (lambda x, v: v)
    old = at(state.errors)  # [code, count, *key]
    first = (old[0] == 0) & (code != 0)
    new = jnp.concatenate([
        jnp.where(first, code, old[0])[None].astype(jnp.int32),
        (old[1] + (code != 0).astype(jnp.int32))[None],
        jnp.where(first, _key_vector(key), old[2:]),
    ])
    return state.replace(errors=put(state.errors, new))


def slot_complete(state: CollectorState) -> jax.Array:
    """``[E, T]`` (``[S, E, T]`` stacked) bool: both halves cover every row of the slot."""
    return jnp.all(state.policy_rows & state.env_rows, axis=-1)


def source_complete(state: CollectorState) -> jax.Array:
    """bool (``[S]`` stacked): every slot of the source's current training step is complete."""
    return jnp.all(slot_complete(state), axis=(-2, -1))


def source_steps(
    plan: TrajectoryPlan, state: CollectorState, s: jax.Array | None = None
) -> TrajectoryStep:
    """Resolved steps of a source, leaves ``[E, T, B, ...]`` (``s`` selects the source of
    a stacked state): ``from_parts`` on the whole buffer, then the delayed reward-model
    scores assigned back over the chunks (``EnvTransition.assign_history_rewards``)."""
    take = _take(state, s)
    step_type = plan.step_type or TrajectoryStep
    env = take(state.env)
    steps = step_type.from_parts(take(state.policy), env, plan)
    if env.transition.reward_assign_lengths is None:
        return steps
    # Delayed reward-model scores reach back over the chunks of the step (the T axis).
    return steps.replace(rewards=env.transition.assign_history_rewards(
        steps.rewards, reward_model_weight=plan.reward_model_weight, time_axis=1
    ))


def _take(state: CollectorState, s: jax.Array | None):
    if state.stacked:
        return lambda tree: jax.tree.map(lambda b: b[s], tree)
    return lambda tree: tree


def materialize(
    plan: TrajectoryPlan, state: CollectorState, s: jax.Array | None = None
) -> Trajectory:
    """The :class:`Trajectory` of a source's current training step.

    The buffers already hold every half in rollout order; the step and trajectory
    types resolve and lay them out (``TrajectoryStep.from_parts``,
    ``Trajectory.from_steps``, or the plan's subclasses). Fields they pass through
    unchanged are the state's buffers themselves. ``s`` (traced) selects the source of
    a stacked state (a copy of its slice). Completeness is not checked here; the
    output modes do. ``Trajectory.episodes`` holds the episodes that ended in the step.
    """
    return materialize_running(plan, state, s)[0]


def used_final_values(plan: TrajectoryPlan, traj: Trajectory) -> jax.Array | None:
    """``traj.final_values`` where they are used, zero elsewhere: where a chunk's first
    episode end bootstraps under ``plan.truncation_bootstrap`` and on each epoch's last
    chunk (``V(s_T)``), the chunks whose env halves must carry them. A trajectory so does
    not depend on whether terminal inference ran where nothing reads it."""
    fv = traj.final_values
    if fv is None:
        return None
    cut, _, _ = traj.transition().first_end_cuts(plan.truncation_bootstrap, rows_ndim=3)
    T = fv.shape[1]
    last = (jnp.arange(T) == T - 1).reshape((1, T, 1))
    used = last if cut is None else cut | last
    used = used.reshape(used.shape + (1,) * (fv.ndim - used.ndim))
    return jnp.where(used, fv, jnp.zeros_like(fv))


def materialize_running(
    plan: TrajectoryPlan, state: CollectorState, s: jax.Array | None = None
) -> tuple[Trajectory, RunningEpisodes]:
    """:func:`materialize`, and the running episodes after the step (what a flush that
    completes the step leaves in the state)."""
    take = _take(state, s)
    sources = take(state.sources)
    step_id = take(state.step)
    traj = (plan.trajectory_type or Trajectory).from_steps(
        source_steps(plan, state, s),
        take(state.initial),
        next_obs_given=take(state.next_obs_given),
        next_rlt_given=take(state.next_rlt_given),
        step_id=step_id,
        env_rank=sources[0],
        stage_id=sources[1],
    )
    traj = traj.replace(final_values=used_final_values(plan, traj))
    stats, after = episode_stats(
        take(state.episodes), take(state.env).transition,
        step_id=step_id, env_rank=sources[0], stage_id=sources[1],
    )
    return traj.replace(episodes=stats), after
