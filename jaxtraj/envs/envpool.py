"""An EnvPool pool (host API) as a runner's :class:`~jaxtraj.runners.service.Env`.

:class:`EnvPoolEnv` executes one action chunk ``[B, K, A]`` as up to ``K`` steps of a
pool made with ``envpool.make(task, env_type="gymnasium", num_envs=B, seed=...)``, with
the same chunk semantics as :class:`~jaxtraj.envs.GymnasiumEnv`: flags are per action
``[B, K]``, ``final_obs`` is the observation the chunk's first episode end left, and
after an episode ends at action ``k`` (``chunk_end``):

- ``"cut"`` (the default): that environment executes nothing more in the chunk. Each
  step is one of EnvPool's partial steps, ``pool.step(actions[live], env_id=live)``, of
  the environments still live; slots ``k + 1 ..`` are padding (``valid_actions``
  false, reward 0, flags false, info zeros); the ended environments are reset with
  ``pool.reset(ended_env_ids)`` at the chunk's end, so the next chunk's policy sees the
  reset observation.
- ``"continue"``: every action is executed; the environment is reset right after the
  step that ended it and runs actions ``k + 1 ..`` in the new episode (not part of the
  ended chunk's return).

EnvPool auto-resets on the *next* step (the step after a done ignores its action,
returns the reset observation and reward 0). This adapter instead calls
``pool.reset(ended_env_ids)`` itself: that returns the same observation the autoreset
would, and the next step executes its action normally, so no action is lost to a reset
step in either mode.

Casting, once here: float observation leaves (EnvPool's are float64) to ``obs_dtype``,
rewards (float32) to ``reward_dtype``, actions to the action space's dtype (MuJoCo
tasks: float64). Actions are clipped to the action space's bounds only with
``clip_actions`` (MuJoCo clamps ``ctrl`` to ``ctrlrange`` in the dynamics; a reward
term such as a control cost may see the action as given). Only the synchronous mode
(``batch_size == num_envs``) is served; its rows (of a full or a partial step, and of a
reset) come back in ``env_id`` order, which every step asserts.

This module imports no envpool at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxtraj.envs.base import ChunkEnv, _replace_rows, require

PyTree = Any


class EnvPoolEnv(ChunkEnv):
    """An EnvPool pool of ``B`` environments stepped ``K`` actions per chunk.

    Args:
      pool: ``envpool.make(task, env_type="gymnasium", num_envs=B, seed=s)`` (env
        ``i`` is seeded ``s + i`` by EnvPool; :meth:`reset` takes no seed), in
        synchronous mode (``batch_size`` unset or ``num_envs``).
      actions_per_chunk: ``K``.
      obs_dtype: as for :class:`~jaxtraj.envs.GymnasiumEnv`.
      reward_dtype: as for :class:`~jaxtraj.envs.GymnasiumEnv`.
      obs_key: as for :class:`~jaxtraj.envs.GymnasiumEnv`.
      per_action_obs: as for :class:`~jaxtraj.envs.GymnasiumEnv`.
      info_keys: as for :class:`~jaxtraj.envs.GymnasiumEnv`.
      success: as for :class:`~jaxtraj.envs.GymnasiumEnv`.
      policy_example: as for :class:`~jaxtraj.envs.GymnasiumEnv`.
      chunk_end: ``"cut"`` (default) or ``"continue"``; see the module docstring.
      clip_actions: clip each action to the pool's action bounds (``action_space.low``
        / ``high``) before it is sent (a NaN stays a NaN). The collector still records
        the actions the policy gave; to record what ran, clip in the policy (see the
        LeRobot guide).

    Raises:
      ValueError: an asynchronous pool (``batch_size < num_envs``), an unsupported
        observation space, spaces that do not match ``policy_example``, an unknown
        ``chunk_end``, or ``clip_actions`` with an action space that has no bounds.
      ImportError: envpool is not installed (the ``envpool`` extra).
    """

    def __init__(
        self,
        pool: Any,
        *,
        actions_per_chunk: int,
        obs_dtype: Any = np.float32,
        reward_dtype: Any = np.float32,
        obs_key: str | None = "state",
        per_action_obs: bool = False,
        info_keys: Sequence[str] = (),
        success: str | None = None,
        policy_example: Any = None,
        chunk_end: str = "cut",
        clip_actions: bool = False,
    ):
        require("envpool", "envpool", "jaxtraj.envs.EnvPoolEnv")
        config = getattr(pool, "config", None)
        if not isinstance(config, dict) or "num_envs" not in config:
            raise TypeError(
                f"EnvPoolEnv takes an envpool pool (envpool.make(..., env_type='gymnasium')), "
                f"got {type(pool).__name__}"
            )
        num_envs = int(config["num_envs"])
        batch = int(config.get("batch_size") or num_envs)
        if batch != num_envs:
            raise ValueError(
                f"EnvPoolEnv serves synchronous pools only (batch_size == num_envs); this pool "
                f"has batch_size {batch}, num_envs {num_envs}"
            )
        space = pool.observation_space
        self._setup(
            num_envs=num_envs,
            obs_space=space,
            action_space=pool.action_space,
            obs_is_dict=hasattr(getattr(space, "spaces", None), "items"),
            obs_dtype=obs_dtype,
            obs_key=obs_key,
            actions_per_chunk=actions_per_chunk,
            per_action_obs=per_action_obs,
            info_keys=info_keys,
            reward_dtype=reward_dtype,
            success=success,
            chunk_end=chunk_end,
            clip_actions=clip_actions,
        )
        self.pool = pool
        self._ids = np.arange(num_envs)
        if policy_example is not None:
            self.check_against(policy_example)

    @classmethod
    def make(
        cls,
        task_id: str,
        num_envs: int,
        *,
        actions_per_chunk: int,
        seed: int = 0,
        make_kwargs: dict | None = None,
        **kwargs: Any,
    ) -> EnvPoolEnv:
        """``EnvPoolEnv(envpool.make(task_id, env_type="gymnasium", num_envs=num_envs,
        seed=seed, **make_kwargs), actions_per_chunk=..., **kwargs)``: a factory a runner
        can call in the thread or process that steps it (picklable as
        ``functools.partial(EnvPoolEnv.make, "HalfCheetah-v4", 16, actions_per_chunk=4,
        seed=1000 * rank)``; a pool itself does not pickle).

        Args:
          task_id: an EnvPool task (``"HalfCheetah-v4"``).
          num_envs: ``B``.
          actions_per_chunk: ``K``.
          seed: EnvPool seeds env ``i`` with ``seed + i``: give rank ``r`` e.g.
            ``1000 * r``.
          make_kwargs: keyword arguments of ``envpool.make`` (``num_threads``,
            ``render_mode``, task options, ...).
          **kwargs: the adapter's (``chunk_end``, ``info_keys``, ...).
        """
        envpool = require("envpool", "envpool", "jaxtraj.envs.EnvPoolEnv.make")
        pool = envpool.make(task_id, env_type="gymnasium", num_envs=num_envs, seed=seed,
                            **(make_kwargs or {}))
        return cls(pool, actions_per_chunk=actions_per_chunk, **kwargs)

    def _rows(self, info: dict, want: np.ndarray, what: str) -> None:
        ids = np.asarray(info["env_id"])
        if not np.array_equal(ids, want):
            raise RuntimeError(
                f"EnvPool {what} returned rows for env_ids {ids.tolist()}, expected {want.tolist()}"
            )

    def _reset_all(self) -> PyTree:
        obs, info = self.pool.reset()
        self._rows(info, self._ids, "reset")
        return self._convert(obs)

    def _step_once(self, actions: np.ndarray) -> tuple:
        raw, r, term, trunc, info = self.pool.step(actions)
        self._rows(info, self._ids, "step")
        term, trunc = np.asarray(term, bool), np.asarray(trunc, bool)
        done = term | trunc
        last = self._convert(raw)
        kept = {}
        everywhere = np.ones(done.shape, bool)
        for name in self._kept_keys:
            if name in info:
                kept[name] = (np.asarray(info[name]), everywhere)
        obs = last
        if done.any():
            ended = np.flatnonzero(done)
            fresh, rinfo = self.pool.reset(ended)
            self._rows(rinfo, ended, "reset")
            fresh = self._convert(fresh)
            obs = _replace_rows(last, ended, fresh)  # new arrays: last keeps the ended ones
        return obs, r, term, trunc, last, kept

    def _step_rows(self, rows: np.ndarray, actions: np.ndarray) -> tuple:
        # A partial step of a synchronous pool: only the env_ids given step.
        raw, r, term, trunc, info = self.pool.step(actions, env_id=rows)
        self._rows(info, rows, "step")
        kept = {}
        present = np.ones((rows.size,), bool)
        for name in self._kept_keys:
            if name in info:
                kept[name] = (np.asarray(info[name]), present)
        return self._convert(raw), r, term, trunc, kept

    def _reset_rows(self, rows: np.ndarray) -> Any:
        fresh, info = self.pool.reset(rows)
        self._rows(info, rows, "reset")
        return self._convert(fresh)

    def render(self, *args: Any, **kwargs: Any) -> Any:
        """The pool's ``render(env_ids=None, camera_id=None)``, where the pool has one
        (made with ``render_mode="rgb_array"``): frames ``[n, H, W, 3]``. Through a
        runner call ``runner.envs[r].render()``: it runs where the pool was built."""
        render = getattr(self.pool, "render", None)
        if not callable(render):
            raise AttributeError(
                f"this EnvPool pool ({type(self.pool).__name__}) has no render(): make it "
                "with render_mode='rgb_array' on an EnvPool that renders"
            )
        return render(*args, **kwargs)

    def close(self) -> None:
        """Close the pool (EnvPool pools have no close; the reference is dropped)."""
        close = getattr(self.pool, "close", None)
        if callable(close):
            close()
