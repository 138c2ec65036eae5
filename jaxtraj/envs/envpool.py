"""An EnvPool pool (host API) as a runner's :class:`~jaxtraj.runners.service.Env`.

:class:`EnvPoolEnv` executes one action chunk ``[B, K, A]`` as ``K`` steps of a pool made
with ``envpool.make(task, env_type="gymnasium", num_envs=B, seed=...)``, with the same
chunk semantics as :class:`~jaxtraj.envs.GymnasiumEnv`: every action is executed, an
environment whose episode ends at action ``k`` is reset at once and runs actions
``k + 1 ..`` in the new episode, flags are per action ``[B, K]``, ``final_obs`` is the
observation the last episode of the chunk ended on.

EnvPool auto-resets on the *next* step (the step after a done ignores its action,
returns the reset observation and reward 0). This adapter instead calls
``pool.reset(ended_env_ids)`` right after the step that ended them: that returns the
same observation the autoreset would, and the next step executes its action normally,
so no action is lost to a reset step.

Casting, once here: float observation leaves (EnvPool's are float64) to ``obs_dtype``,
rewards (float32) to ``reward_dtype``, actions to the action space's dtype (MuJoCo
tasks: float64). Only the synchronous mode (``batch_size == num_envs``) is served; its
rows come back in ``env_id`` order, which every step asserts.

This module imports no envpool at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxtraj.envs.gymnasium import ChunkEnv, require

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

    Raises:
      ValueError: an asynchronous pool (``batch_size < num_envs``), an unsupported
        observation space, or spaces that do not match ``policy_example``.
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
        )
        self.pool = pool
        self._ids = np.arange(num_envs)
        if policy_example is not None:
            self.check_against(policy_example)

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

    def close(self) -> None:
        """Close the pool (EnvPool pools have no close; the reference is dropped)."""
        close = getattr(self.pool, "close", None)
        if callable(close):
            close()


def _replace_rows(tree: PyTree, rows: np.ndarray, new: PyTree) -> PyTree:
    def one(x, y):
        x = np.array(x, copy=True)
        x[rows] = y
        return x

    return jax.tree.map(one, tree, new)
