"""LeRobot mode: completed episodes, with in-progress episodes carried across steps.

Completion scope: one training step of one source, as in rollout mode. Its flush
turns the step's ``Trajectory`` into dataset frames (``trajectory_frames``), appends
them to every environment's running episode on device (:mod:`jaxtraj.episodes`) and
emits the episodes that ended; the host facade transfers them once per flush and
hands them to a dataset writer (``jaxtraj.lerobot_writer.LeRobotWriter``).
"""

from __future__ import annotations

import math

import jax

from jaxtraj import episodes as ep_lib
from jaxtraj import joiner, rollout
from jaxtraj.joiner import CollectorState
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import trajectory_frames


def actions_per_chunk(state: CollectorState, plan: TrajectoryPlan) -> int:
    """``K``: the per-action axis of ``EnvTransition.rewards`` or ``dones``, else 1."""
    tr = state.env.transition
    lead = state.policy_rows.ndim
    for x in (tr.rewards, tr.dones, tr.terminations, tr.truncations):
        if x is not None and x.ndim > lead:
            return x.shape[lead]
    return 1


def frames_of(plan: TrajectoryPlan, state: CollectorState, traj) -> tuple[dict, jax.Array]:
    return trajectory_frames(
        traj,
        per_action=plan.lerobot_frame == "action",
        actions_per_chunk=actions_per_chunk(state, plan),
        state_key=plan.lerobot_state_key,
    )


def init_episodes(plan: TrajectoryPlan, state: CollectorState) -> ep_lib.EpisodeState:
    """Empty running-episode buffers for one single-source state."""
    example = jax.eval_shape(lambda st: frames_of(plan, st, rollout.flush(plan, st)[1])[0], state)
    return ep_lib.init_episodes(example, plan.batch_size, plan.max_episode_length)


def features(plan: TrajectoryPlan, policy_example, env_example) -> dict[str, dict]:
    """The frame features of a run, as a LeRobot ``info.json`` declares them.

    ``{name: {"dtype": ..., "shape": [D], "names": None}}``; scalars have shape ``[1]``.
    """
    state = jax.eval_shape(lambda: joiner.init(plan, policy_example, env_example, sources=(0, 0)))
    frames = jax.eval_shape(lambda st: init_episodes(plan, st).frames, state)
    return {
        name: {"dtype": str(x.dtype), "shape": [int(math.prod(x.shape[2:]))], "names": None}
        for name, x in frames.items()
    }


def flush(
    plan: TrajectoryPlan, state: CollectorState, episodes: ep_lib.EpisodeState
) -> tuple[CollectorState, ep_lib.EpisodeState, ep_lib.EpisodeBatch]:
    """Flush one single-source state's complete step into its running episodes.

    Returns ``(state, episodes, batch)``. If ``batch.overflow`` is set anywhere, or the
    step was incomplete (``state.error_code``), discard all three and keep the inputs
    (do not donate them).
    """
    state, traj = rollout.flush(plan, state)
    frames, done = frames_of(plan, state, traj)
    episodes, batch = ep_lib.append(
        episodes, frames, done, truncate=plan.episode_overflow == "truncate"
    )
    return state, episodes, batch
