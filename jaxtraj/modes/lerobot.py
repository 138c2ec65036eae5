"""LeRobot mode: completed episodes, with in-progress episodes carried across steps.

Completion scope: one training step of one source, as in rollout mode. Its flush
turns the step's ``Trajectory`` into dataset frames (``trajectory_frames``), appends
them to every environment's running episode on device (:mod:`jaxtraj.episodes`) and
emits the episodes that ended; the facade transfers them once per flush and hands them
to a dataset writer (``jaxtraj.lerobot.LeRobotWriter``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxtraj import episodes as ep_lib
from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.modes import rollout
from jaxtraj.modes._layout import PerSource
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.state import CollectorState
from jaxtraj.state import init as init_state
from jaxtraj.types import trajectory_frames


def frames_of(plan: TrajectoryPlan, state: CollectorState, traj) -> tuple[dict, jax.Array]:
    """The dataset frames of a flushed trajectory; ``K`` comes from the action chunk."""
    return trajectory_frames(
        traj,
        per_action=plan.lerobot_frame == "action",
        actions_per_chunk=state.actions_per_chunk,
        state_key=plan.lerobot_state_key,
    )


def init(plan: TrajectoryPlan, state: CollectorState) -> ep_lib.EpisodeState:
    """Empty running-episode buffers for one single-source state.

    Raises:
      ValueError: one frame per action (``lerobot_frame="action"``) of chunks of ``K > 1``
        actions, but the env example carries no per-action observations
        (``EnvPart.action_obs``): every frame of a chunk would show the chunk's first
        observation, and a new episode's first frames the old episode's.
    """
    k = state.actions_per_chunk
    if plan.lerobot_frame == "action" and k > 1 and state.env.action_obs is None:
        raise ValueError(
            f"lerobot mode records one frame per action (lerobot_frame='action') of chunks of "
            f"K = {k} actions, so each frame needs the observation its action was taken "
            "from: give the env example and every env half EnvPart.action_obs (leaves "
            "[B, K, ...], like the policy half's obs; jaxtraj.envs adapters: "
            "per_action_obs=True), or record one frame per chunk (lerobot_frame='chunk')"
        )
    example = jax.eval_shape(lambda st: frames_of(plan, st, rollout.flush(plan, st)[0])[0], state)
    return ep_lib.init_episodes(example, plan.batch_size, plan.max_episode_length)


def features(
    plan: TrajectoryPlan, policy_example, env_example, *, cameras: str | dict[str, str] = "video"
) -> dict[str, dict]:
    """The frame features of a run, as a LeRobot ``info.json`` declares them.

    Vectors ``{"dtype": ..., "shape": [D], "names": None}`` (scalars ``[1]``); cameras
    (``[H, W, 3]`` uint8 observation leaves, see ``trajectory_frames``)
    ``{"dtype": "video", "shape": [H, W, 3], "names": ["height", "width", "channels"]}``.

    Args:
      cameras: how cameras are stored: ``"video"`` (mp4, the default, as LeRobot records)
        or ``"image"`` (PNG in the data files), for all, or a dict feature name -> kind.
    """
    state = jax.eval_shape(lambda: init_state(plan, policy_example, env_example, sources=(0, 0)))
    frames = jax.eval_shape(lambda st: init(plan, st).frames, state)
    out = {}
    for name, x in frames.items():
        if name.startswith("observation.images."):
            kind = cameras.get(name, "video") if isinstance(cameras, dict) else cameras
            if kind not in ("video", "image"):
                raise ValueError(f"camera {name!r}: kind must be 'video' or 'image', got {kind!r}")
            names = ["height", "width", "channels"]
            out[name] = {"dtype": kind, "shape": list(x.shape[2:]), "names": names}
        else:
            shape = [int(math.prod(x.shape[2:]))]
            out[name] = {"dtype": str(x.dtype), "shape": shape, "names": None}
    return out


def flush(
    plan: TrajectoryPlan, state: CollectorState, episodes: ep_lib.EpisodeState
) -> tuple[ep_lib.EpisodeBatch, CollectorState, ep_lib.EpisodeState]:
    """Flush one single-source state's complete step into its running episodes.

    A dataset records what the environment gave: rewards are composed with the plan's
    weights and reward model (``Trajectory.rewards``), never with the truncation bootstrap
    ``gamma * V(final obs)`` (a device of the training targets). Frames are the actions
    that ran: a chunk cut at an episode end records its actions up to the end, done on
    its last valid frame; under ``chunk_end="continue"`` the frames after an end belong to
    the new episode.

    Returns ``(batch, state, episodes)``. If ``batch.overflow`` is set anywhere, or the
    step was incomplete (``state.error_code``), discard all three and keep the inputs
    (do not donate them).
    """
    traj, state = rollout.flush(plan, state)
    frames, done, valid = frames_of(plan, state, traj)
    episodes, batch = ep_lib.append(
        episodes, frames, done, truncate=plan.episode_overflow == "truncate", valid=valid
    )
    return batch, state, episodes


@dataclasses.dataclass(frozen=True, eq=False)
class LeRobot(PerSource):
    """LeRobot mode in the common form of :mod:`jaxtraj.modes`; scopes are source indices.

    Args:
      plan: the plan.
      writer: an object with ``add_episodes(episodes, tasks)`` (e.g. a
        ``jaxtraj.lerobot.LeRobotWriter``) or ``None``.
      tasks: the task string of every environment (one string for all, or one per
        environment index).
    """

    plan: TrajectoryPlan
    writer: Any = None
    tasks: str | Sequence[str] = "default"

    def __post_init__(self):
        B = self.plan.batch_size
        tasks = [self.tasks] * B if isinstance(self.tasks, str) else list(self.tasks)
        if len(tasks) != B or not all(isinstance(t, str) and t for t in tasks):
            raise ValueError(f"tasks must be one non-empty string or {B} of them, got {self.tasks!r}")
        object.__setattr__(self, "tasks", tuple(tasks))
        # Host bookkeeping: frames of running episodes per state (what the writer has not
        # received), and the running lengths of the flush being emitted.
        object.__setattr__(self, "_books", {"running": {}, "pending": None})

    # -- pure ---------------------------------------------------------------------------

    def init(self, state: CollectorState) -> ep_lib.EpisodeState:
        return init(self.plan, state)

    def ready(self, state: CollectorState, mode_state: Any = None) -> jax.Array:
        return rollout.ready(state)

    def flush(self, state, mode_state, scope=None, current_version=0):
        return flush(self.plan, state, mode_state)

    # -- host ---------------------------------------------------------------------------

    scopes = rollout.Rollout.scopes
    state_index = rollout.Rollout.state_index
    scope_name = rollout.Rollout.scope_name
    scope_index = rollout.Rollout.scope_index
    place = rollout.Rollout.place
    describe = rollout.Rollout.describe
    advance = rollout.Rollout.advance

    def compiled_flush(self, state, mode_state, scope, current_version, *, owned: bool):
        # Not donated: if an episode overflows, the old state and episodes are kept.
        batch, state, episodes = _compiled(self.plan)(state, mode_state)
        self._books["pending"] = (scope, episodes.length)  # counted once it is emitted
        return batch, state, episodes

    def end(self, mode_state: ep_lib.EpisodeState, state_index: int) -> tuple[list, Any]:
        """End the recording of one source: every running episode is handed to the writer
        with its last frame marked done and truncated (the recording ended it, not the
        environment); no episode runs after it.

        Returns ``([(queue_key, [(env_index, frames), ...])], episodes)``.
        """
        running = ep_lib.running_episodes(mode_state)
        done = [(b, frames) for b, frames in enumerate(running) if frames is not None]
        if self.writer is not None and done:
            self.writer.add_episodes([f for _, f in done], [self.tasks[b] for b, _ in done])
        self._count(state_index, 0)
        return ([(self.plan.queue_key, done)] if done else []), ep_lib.cleared(mode_state)

    def restored(self, mode_states: list) -> None:
        """After ``load_state_dict``: the running episodes' frames, counted again (what the
        writer's ``close()`` reports as unwritten)."""
        for i, episodes in enumerate(mode_states):
            self._count(i, int(np.asarray(episodes.length).sum()))

    def _count(self, state_index: int, frames: int) -> None:
        """Tell the writer how many frames of running episodes it has not received."""
        running = self._books["running"]
        running[state_index] = frames
        if self.writer is not None and hasattr(self.writer, "running_frames"):
            self.writer.running_frames = sum(running.values())

    def emit(self, items: ep_lib.EpisodeBatch, scope: int, mirror) -> list[tuple[str, Any]]:
        """The episodes that ended, as ``(env_index, frames)``, handed to the writer.

        Raises:
          CollectorError: ``EPISODE_OVERFLOW`` (before anything is written or kept).
        """
        overflow = np.asarray(items.overflow)
        if overflow.any():
            envs = np.flatnonzero(overflow).tolist()
            raise CollectorError(
                self.describe(scope, mirror), ErrorCode.EPISODE_OVERFLOW, f"environments {envs}"
            )
        done = [
            (b, frames)
            for b, eps in enumerate(ep_lib.completed_episodes(items))
            for frames in eps
        ]
        if self.writer is not None and done:
            self.writer.add_episodes([f for _, f in done], [self.tasks[b] for b, _ in done])
        pending = self._books["pending"]
        if pending is not None and pending[0] == scope:
            self._count(scope, int(np.asarray(pending[1]).sum()))
        return [(self.plan.queue_key, done)]


@functools.cache
def _compiled(plan: TrajectoryPlan):
    return jax.jit(functools.partial(flush, plan))
