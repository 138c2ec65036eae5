"""A gymnasium ``VectorEnv`` as a runner's :class:`~jaxtraj.runners.service.Env`.

:class:`GymnasiumEnv` executes one action chunk ``[B, K, A]`` as up to ``K`` steps of a
gymnasium (>= 1.1) vector env of ``B`` sub-environments and reports what happened as an
:class:`~jaxtraj.runners.service.EnvStep`: per-action rewards, terminations and
truncations ``[B, K]``, the observation the next chunk's policy sees, the observation an
episode ended on (``final_obs``, for terminal inference on the policy side) and, when
asked, the observation each action was taken from (``action_obs``) and per-action
``info`` values.

What happens after an episode ends inside a chunk is the adapter's ``chunk_end``:

- ``"cut"`` (the default for a ``SyncVectorEnv``): an environment whose episode ends at
  action ``k`` executes nothing more in this chunk. Its slots ``k + 1 ..`` are padding:
  ``valid_actions`` false, reward 0, flags and success false, info zeros. It is reset at
  the chunk's end, so ``obs`` (the next chunk's observation) is the new episode's first
  and ``final_obs`` the one the episode ended on. ``EnvStep.transition.valid_actions``
  ``[B, K]`` says which actions ran (all of them where nothing ended). The adapter steps
  the live sub-environments itself (``vector_env.envs[i].step``; ``vector_env.step`` is
  never called, so the autoreset mode does not matter) and resets the ended ones with
  ``vector_env.reset(options={"reset_mask": ended})``, which continues their random
  streams as an autoreset would.
- ``"continue"`` (the default, and the only mode, for an ``AsyncVectorEnv``): every
  action is executed; an environment whose episode ends at action ``k`` is reset at once
  and its actions ``k + 1 ..`` run in the new episode (action ``k + 1``'s observation
  is the new episode's first); no ``valid_actions``. Those actions are not part of the
  ended chunk's return (the chunk-end rule, ``EnvTransition.owned_actions``).

In both modes flags are per action ``[B, K]`` (a chunk is done if any of its actions
is) and ``final_obs`` is, per environment, the observation the chunk's *first* episode
end left (the one whose ``V`` bootstraps the chunk), or ``obs`` where no episode ended.

Under ``"continue"`` the vector env's autoreset mode (``metadata["autoreset_mode"]``) is
served as follows, and all three give the same trajectory from the same seeds and
actions:

- ``SAME_STEP``: native; the ended episode's observation is ``info["final_obs"]``;
- ``NEXT_STEP`` and ``DISABLED``: the ended environments are reset right after the step
  with ``reset(options={"reset_mask": done})``, which continues each sub-environment's
  random stream as an autoreset would and clears a pending ``NEXT_STEP`` autoreset.

Casting happens once, here at the boundary: float observation leaves to ``obs_dtype``
(integer leaves such as ``uint8`` images keep their dtype), rewards to ``reward_dtype``,
actions to the action space's dtype. Non-finite values are not touched (a NaN stays a
NaN, a float64 beyond the float32 range becomes ``inf``): the collector's checks see
them as the environment gave them.

This module imports no gymnasium at import time. What the adapters share (the base class
:class:`~jaxtraj.envs.base.ChunkEnv`, :class:`~jaxtraj.envs.EnvSpec`,
:func:`~jaxtraj.envs.example_parts`) is in :mod:`jaxtraj.envs.base`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxtraj.envs.base import ChunkEnv, check_chunk_end, require

PyTree = Any

# The gymnasium release that added autoreset modes and reset(options={"reset_mask": ...}).
_GYMNASIUM_MIN = (1, 1)


def _stack_obs(items: Sequence[Any]) -> PyTree:
    """Single environments' observations (arrays or nested mappings) -> one batch."""
    first = items[0]
    if hasattr(first, "items"):
        return {k: _stack_obs([x[k] for x in items]) for k in first}
    return np.stack([np.asarray(x) for x in items])


def info_rows(src: Any, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(values, present)`` of a gymnasium-style vector ``info[name]`` (masked by
    ``info["_" + name]``) restricted to ``rows``; ``None`` if absent."""
    if not src or name not in src:
        return None
    values = np.asarray(src[name])
    present = np.asarray(src.get("_" + name, np.ones(rows.shape, bool)), bool) & rows
    return values, present


def merge_info(parts: Sequence[tuple[np.ndarray, np.ndarray] | None]):
    """Several ``(values, present)`` over disjoint rows -> one (``None`` if all absent)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    values, present = np.array(parts[0][0], copy=True), parts[0][1].copy()
    for v, p in parts[1:]:
        if values.dtype != np.asarray(v).dtype:
            values = values.astype(np.result_type(values, np.asarray(v)))
        values[p] = np.asarray(v)[p]
        present |= p
    return values, present


# --------------------------------------------------------------------------- gymnasium


class GymnasiumEnv(ChunkEnv):
    """A gymnasium (>= 1.1) ``VectorEnv`` of ``B`` sub-environments stepped ``K``
    actions per chunk: a runner's :class:`~jaxtraj.runners.service.Env`.

    One chunk ``[B, K, A]`` is up to ``K`` steps of each sub-environment; flags are per
    action ``[B, K]``; ``final_obs`` is the observation of each environment's first
    episode end in the chunk. After an episode ends at action ``k`` (``chunk_end``):

    - ``"cut"`` (default for a ``SyncVectorEnv``): that environment executes nothing
      more in the chunk (slots ``k + 1 ..``: ``valid_actions`` false, reward 0, flags
      false) and is reset at the chunk's end, so the next chunk's policy sees the reset
      observation. The adapter steps ``vector_env.envs[i]`` itself (never
      ``vector_env.step``: any autoreset mode) and resets with
      ``vector_env.reset(options={"reset_mask": ended})``. Vector-level wrappers would
      be bypassed, so a wrapped vector env (no ``envs``) defaults to ``"continue"``;
      wrap the single environments instead (``make_vec(..., wrappers=[...])``).
    - ``"continue"`` (default, and the only mode, for an ``AsyncVectorEnv`` or a wrapped
      vector env): every action is executed; the environment is reset at once and runs
      actions ``k + 1 ..`` in its new episode (not part of the ended chunk's return).
      ``SAME_STEP``, ``NEXT_STEP`` and ``DISABLED`` autoreset modes all give this
      (``NEXT_STEP`` / ``DISABLED`` by resetting ended envs right after the step with
      ``reset_mask``), the same trajectory from the same seeds and actions.

    Casting, once here: float observation leaves to ``obs_dtype`` (integer leaves such
    as images keep theirs), rewards to ``reward_dtype``, actions to the action space's
    dtype (Hopper-v5: float32; whatever the policy gives is cast). Actions are clipped to
    the action space's bounds only with ``clip_actions``: gymnasium's MuJoCo envs do not
    clip (MuJoCo clamps ``ctrl`` to ``ctrlrange`` in the dynamics, but a reward term such
    as Hopper's control cost sees the action as given).

    Args:
      vector_env: a ``gymnasium.vector.VectorEnv`` (``SyncVectorEnv``,
        ``AsyncVectorEnv``, or one that serves ``metadata["autoreset_mode"]`` and
        ``reset(options={"reset_mask": ...})`` like them).
      actions_per_chunk: ``K``.
      obs_dtype: the dtype float observations are cast to.
      reward_dtype: the dtype rewards are cast to.
      obs_key: a Box observation becomes ``{obs_key: array}`` (the array alone if
        ``None``); a Dict observation space gives a dict of arrays.
      per_action_obs: also report ``action_obs`` ``[B, K, ...]``.
      info_keys: ``info`` entries kept per action as ``EnvStep.info[name]`` ``[B, K]``
        (zero where an env did not report it; the step's own info, also on the action
        that ended an episode).
      success: ``EnvTransition.success`` per action (what a LeRobot dataset records as
        ``next.success``): ``"terminations"`` (a task that ends when it succeeds), the
        name of an ``info`` entry (``"is_success"``: true where nonzero), or ``None``.
      seed: the first :meth:`reset` seeds sub-env ``i`` with ``seed + i``; later resets
        take no seed.
      policy_example: a collector, policy example or ``(policy, env)`` example pair to
        check the spaces against at construction (:meth:`check_against`).
      chunk_end: ``"cut"`` or ``"continue"`` (see above); ``None``: ``"cut"`` for a
        ``SyncVectorEnv``, else ``"continue"``.
      clip_actions: clip each action to the Box action space's ``low`` / ``high``
        before it is sent to the environment (a NaN stays a NaN). The collector still
        records the actions the policy gave; to record what ran, clip in the policy
        (see the LeRobot guide).

    Raises:
      ValueError: an autoreset mode this adapter cannot serve, an unsupported
        observation space, spaces that do not match ``policy_example``, an unknown
        ``chunk_end``, ``clip_actions`` with an action space that has no bounds, or
        ``"cut"`` for a vector env whose sub-environments are not in this process
        (``AsyncVectorEnv``) or that is wrapped.
      ImportError: gymnasium is not installed (the ``gymnasium`` extra).
    """

    def __init__(
        self,
        vector_env: Any,
        *,
        actions_per_chunk: int,
        obs_dtype: Any = np.float32,
        reward_dtype: Any = np.float32,
        obs_key: str | None = "state",
        per_action_obs: bool = False,
        info_keys: Sequence[str] = (),
        success: str | None = None,
        seed: int | None = None,
        policy_example: Any = None,
        chunk_end: str | None = None,
        clip_actions: bool = False,
    ):
        gym = require("gymnasium", "gymnasium", "jaxtraj.envs.GymnasiumEnv")
        vector = importlib.import_module("gymnasium.vector")
        if not isinstance(vector_env, vector.VectorEnv):
            raise TypeError(
                f"GymnasiumEnv takes a gymnasium.vector.VectorEnv, got {type(vector_env).__name__}"
                " (gymnasium.make_vec(...) makes one)"
            )
        own = isinstance(vector_env, vector.SyncVectorEnv)  # its sub-envs, here and unwrapped
        if chunk_end is None:
            chunk_end = "cut" if own else "continue"
        check_chunk_end(chunk_end, "GymnasiumEnv")
        if chunk_end == "cut" and not own:
            raise ValueError(
                f"GymnasiumEnv: chunk_end='cut' steps only the sub-environments still live in "
                f"a chunk, which needs them in this process: a gymnasium SyncVectorEnv "
                f"(gymnasium.make_vec(..., vectorization_mode='sync'), wrappers on the single "
                f"envs), not a {type(vector_env).__name__}. Use chunk_end='continue' with it "
                f"(an episode's end resets at once; the chunk's remaining actions run in the "
                f"new episode)"
            )
        space = vector_env.single_observation_space
        self._setup(
            num_envs=vector_env.num_envs,
            obs_space=space,
            action_space=vector_env.single_action_space,
            obs_is_dict=isinstance(space, gym.spaces.Dict),
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
        self.env = vector_env
        self.seed = seed
        self._mode = self._serve_mode(gym, vector, vector_env)
        self._seeded = False
        if policy_example is not None:
            self.check_against(policy_example)

    @classmethod
    def make(
        cls,
        env_id: str,
        num_envs: int,
        *,
        actions_per_chunk: int,
        make_kwargs: dict | None = None,
        **kwargs: Any,
    ) -> GymnasiumEnv:
        """``GymnasiumEnv(gymnasium.make_vec(env_id, num_envs, vectorization_mode="sync",
        **make_kwargs), actions_per_chunk=..., **kwargs)``: a factory a runner can call in
        the thread or process that steps it (picklable as
        ``functools.partial(GymnasiumEnv.make, "Hopper-v5", 4, actions_per_chunk=4,
        seed=1000 * rank)``).

        Args:
          env_id: a registered gymnasium id (``"Hopper-v5"``).
          num_envs: ``B``.
          actions_per_chunk: ``K``.
          make_kwargs: keyword arguments of ``gymnasium.make_vec`` (``render_mode``,
            ``wrappers``, environment arguments, ...).
          **kwargs: the adapter's (``seed``, ``chunk_end``, ``info_keys``, ...).
        """
        gym = require("gymnasium", "gymnasium", "jaxtraj.envs.GymnasiumEnv.make")
        make_kwargs = {"vectorization_mode": "sync", **(make_kwargs or {})}
        vec = gym.make_vec(env_id, num_envs=num_envs, **make_kwargs)
        return cls(vec, actions_per_chunk=actions_per_chunk, **kwargs)

    @staticmethod
    def _serve_mode(gym: Any, vector: Any, vector_env: Any) -> str:
        version = tuple(int(p) for p in gym.__version__.split(".")[:2] if p.isdigit())
        mode = vector_env.metadata.get("autoreset_mode")
        modes = getattr(vector, "AutoresetMode", None)
        served = "SAME_STEP, NEXT_STEP and DISABLED (gymnasium >= 1.1)"
        if modes is None or version < _GYMNASIUM_MIN:
            name = getattr(mode, "name", mode) if mode is not None else "NEXT_STEP"
            raise ValueError(
                f"autoreset mode {name} of gymnasium "
                f"{gym.__version__} cannot be served: it has no reset(options={{'reset_mask': "
                f"...}}); served: {served}"
            )
        if mode is None:
            mode = modes.NEXT_STEP  # gymnasium's default for vector envs without the tag
        try:
            mode = modes(mode)
        except ValueError:
            raise ValueError(
                f"autoreset mode {mode!r} cannot be served; served: {served}"
            ) from None
        return mode.name  # "SAME_STEP", "NEXT_STEP" or "DISABLED"

    @property
    def autoreset_mode(self) -> str:
        """The vector env's autoreset mode: ``"SAME_STEP"``, ``"NEXT_STEP"`` or
        ``"DISABLED"``."""
        return self._mode

    def _reset_all(self) -> PyTree:
        seed = None if self._seeded else self.seed
        obs, _ = self.env.reset(seed=seed)
        self._seeded = True
        return self._convert(obs)

    def _step_once(self, actions: np.ndarray) -> tuple:
        raw, r, term, trunc, info = self.env.step(actions)
        term, trunc = np.asarray(term, bool), np.asarray(trunc, bool)
        done = term | trunc
        obs = self._convert(raw)
        last, kept = obs, {}
        if self._mode == "SAME_STEP":
            # Ended rows: obs is the new episode's, info its reset info; the step's
            # observation and info are under final_obs / final_info.
            if done.any():
                last = jax.tree.map(np.copy, obs)
                for i in np.flatnonzero(np.asarray(info["_final_obs"], bool) & done):
                    _set_row(last, i, self._convert(info["final_obs"][i]))
            final_info = info.get("final_info", {}) if done.any() else {}
            for name in self._kept_keys:
                got = merge_info([info_rows(info, name, ~done), info_rows(final_info, name, done)])
                if got is not None:
                    kept[name] = got
        else:
            for name in self._kept_keys:
                got = info_rows(info, name, np.ones(done.shape, bool))
                if got is not None:
                    kept[name] = got
            if done.any():
                raw, _ = self.env.reset(options={"reset_mask": done.copy()})
                obs = self._convert(raw)
        return obs, r, term, trunc, last, kept

    def _step_rows(self, rows: np.ndarray, actions: np.ndarray) -> tuple:
        envs = self.env.envs
        steps = [envs[i].step(a) for i, a in zip(rows.tolist(), actions)]
        obs = self._convert(_stack_obs([s[0] for s in steps]))
        r = np.asarray([s[1] for s in steps])
        term = np.asarray([bool(s[2]) for s in steps])
        trunc = np.asarray([bool(s[3]) for s in steps])
        kept = {}
        for name in self._kept_keys:  # each sub-env's own info: the ending step's included
            got = [(j, s[4][name]) for j, s in enumerate(steps) if name in s[4]]
            if got:
                values = np.zeros((rows.size,), np.asarray(got[0][1]).dtype)
                present = np.zeros((rows.size,), bool)
                for j, v in got:
                    values[j], present[j] = v, True
                kept[name] = (values, present)
        return obs, r, term, trunc, kept

    def _reset_rows(self, rows: np.ndarray) -> PyTree:
        mask = np.zeros((self.num_envs,), bool)
        mask[rows] = True
        # Exactly the masked sub-envs, seed None (their streams continue); the rows of
        # the others are the vector's stale buffers and are not read.
        raw, _ = self.env.reset(options={"reset_mask": mask})
        return jax.tree.map(lambda x: x[rows], self._convert(raw))

    def render(self) -> Any:
        """The vector env's ``render()``: with ``render_mode="rgb_array"``, a tuple of each
        sub-environment's frame. Through a runner call ``runner.envs[r].render()``
        (``RayRunner.call_env(r, "render")``): it runs where the env was built, as a
        MuJoCo camera needs."""
        return self.env.render()

    def close(self) -> None:
        """Close the vector env."""
        self.env.close()


def _set_row(tree: PyTree, i: int, one: PyTree) -> None:
    """``tree[..][i] = one[..]`` leaf by leaf (``one``: a single env's observation)."""
    for leaf, x in zip(jax.tree.leaves(tree), jax.tree.leaves(one)):
        leaf[i] = x
