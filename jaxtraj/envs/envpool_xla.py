"""EnvPool stepped through its XLA interface inside the synchronous runner's ``lax.scan``.

:class:`EnvPoolXla` wraps an EnvPool pool as an env driver
(:class:`jaxtraj.runners.sync.EnvDriver`): the runner's jitted scan steps the C++
simulators (MuJoCo, ...) through EnvPool's XLA custom call, with policy inference and the
collector's inserts in the same compiled program and no host round trip per step::

    import envpool, jax
    jax.config.update("jax_enable_x64", True)        # required, see below
    pool = envpool.make("Hopper-v4", env_type="gymnasium", num_envs=16, seed=0)
    env = EnvPoolXla(pool, actions_per_chunk=4)
    pe, ve = sync.example_parts(env, None, policy_fn, value_fn, params, 16, 4)
    carry = sync.reset(env, None, rng, 16, 4)          # resets the pool (host call)
    collect = sync.make_collect(plan, env, None, policy_fn, value_fn)

What a user must know:

- ``jax_enable_x64`` must be on before anything is traced: EnvPool's XLA step takes
  float64 actions (MuJoCo's ``action`` spec) and gives float64 observations, which JAX
  represents only with x64. The driver casts at the boundary: actions to the pool's
  action dtype, observations to ``obs_dtype`` (float32 by default), rewards to float32,
  flags to bool, so the collector's buffers keep the plan's dtypes. With x64 on, JAX's
  *defaults* widen too (``jnp.zeros(n)`` is float64, ``jnp.arange`` int64): give the
  policy's parameters and outputs explicit dtypes, or its parts (and the plan's buffers
  built from them) are float64. jaxtraj's keys are int32 either way.
- The env state carried through the scan is ``(handle, reset_pending [B])``: EnvPool's
  handle is a token for the C++ pool, not its state. The jitted call threads it so the steps stay ordered, but the
  simulators live outside JAX: a carry cannot be rewound or copied (calling ``collect``
  twice with the same carry steps the pool further, it does not repeat the rollout).
  ``rng`` is ignored: EnvPool's randomness is its ``seed`` at ``envpool.make``.
- Chunk ends: this driver can only *continue* (``chunk_end="continue"``; ``"cut"`` is
  refused): EnvPool's XLA step steps every environment in lockstep and has no partial
  step or reset of single environments, so an episode that ends at action ``k`` is
  followed in the same chunk by the next episode.
- Auto-reset is EnvPool's, on the *next* step: the step after an episode ends is a
  reset step. Its action is not executed (EnvPool ignores it), its reward is 0 and its
  flags are false, and its observation is the new episode's first one. An episode that
  ends at action ``k`` of a chunk consumes action ``k + 1`` (the next chunk's first
  action if ``k = K - 1``; that chunk's policy then saw the observation the episode
  ended on). The env half's ``EnvTransition.valid_actions`` ``[B, K]`` is false on
  every reset step and true elsewhere, so no loss trains on an action that never ran;
  a per-environment "reset pending" flag in the driver's env state carries a chunk's
  last-action end into the next chunk. The actions after an end (the reset step and
  the new episode's) are not part of the ended chunk's return (the chunk-end rule,
  ``EnvTransition.owned_actions``). ``final_obs`` (terminal inference, truncation
  bootstrap) is the observation the chunk's first episode end left.
- The pool must be synchronous (``batch_size == num_envs``), reset by
  :func:`jaxtraj.runners.sync.reset` (a host call) before the first ``collect``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtraj.envs.base import check_chunk_end
from jaxtraj.runners import sync

__all__ = ["EnvPoolXla"]

X64_MESSAGE = (
    "EnvPoolXla needs jax_enable_x64: EnvPool's XLA step takes {dtype} actions. Call "
    'jax.config.update("jax_enable_x64", True) before tracing (at program start).'
)


class EnvPoolXla:
    """An EnvPool pool as an env driver for :mod:`jaxtraj.runners.sync`.

    Args:
      pool: a synchronous EnvPool pool (``envpool.make(..., num_envs=B)``, gymnasium
        or gym ``env_type``) with one continuous or discrete action array.
      actions_per_chunk: ``K``, the actions of one chunk.
      obs_dtype: observations are cast to this dtype (float32 by default); ``None``
        keeps EnvPool's (float64 for MuJoCo).
      obs_key: for dict observations, the key (or a tuple of keys) that is the
        observation; ``None`` takes the whole observation.
      clip_actions: clip actions to the pool's action bounds before they are sent (the
        collector still records the policy's unclipped actions).
      reward_dtype: rewards are cast to this dtype (float32).
      chunk_end: ``"continue"``, the only mode this driver has (see the module
        docstring); ``"cut"`` raises ValueError.
    """

    chunk_end = "continue"

    def __init__(
        self,
        pool: Any,
        actions_per_chunk: int,
        *,
        obs_dtype: Any = jnp.float32,
        obs_key: Any = None,
        clip_actions: bool = False,
        reward_dtype: Any = jnp.float32,
        chunk_end: str = "continue",
    ):
        check_chunk_end(chunk_end, "EnvPoolXla")
        if chunk_end == "cut":
            raise ValueError(
                "EnvPoolXla: chunk_end='cut' is not possible: EnvPool's XLA step steps "
                "every environment in lockstep (no partial step, no reset of single "
                "environments), so it can only continue; its reset step is masked "
                "(valid_actions false). For chunks cut at an episode end use the host "
                "adapter jaxtraj.envs.EnvPoolEnv (partial steps)"
            )
        config = pool.config
        self.num_envs = int(config["num_envs"])
        if int(config["batch_size"]) != self.num_envs:
            raise ValueError(
                f"EnvPoolXla needs a synchronous pool (batch_size == num_envs), got "
                f"batch_size={config['batch_size']}, num_envs={self.num_envs}"
            )
        self.actions_per_chunk = int(actions_per_chunk)
        self.pool = pool
        self.obs_dtype, self.obs_key, self.reward_dtype = obs_dtype, obs_key, reward_dtype
        space = pool.spec.action_space
        self.action_shape = tuple(space.shape)
        self.action_dtype = np.dtype(space.dtype)
        self._bounds = None
        if clip_actions:
            self._bounds = (np.asarray(space.low), np.asarray(space.high))
        xla = pool.xla()
        self._handle, self._step = np.asarray(xla[0]), xla[3]
        obs_space = pool.spec.observation_space
        self._obs_spec = self._select(
            jax.tree.map(
                lambda s: jax.ShapeDtypeStruct((self.num_envs, *s.shape), self._obs_out(s.dtype)),
                _space_tree(obs_space),
            )
        )

    # -- the EnvDriver protocol -------------------------------------------------------

    def init(self, rng: jax.Array) -> tuple[tuple[jax.Array, jax.Array], Any]:
        """Reset the pool (a host call: outside ``jit``) -> ``((handle, reset_pending
        [B] all false), obs [B, ...])``.

        ``rng`` is ignored: the pool's ``seed`` decides its episodes.
        """
        del rng
        self._check_x64()
        out = self.pool.reset()
        obs = out[0] if isinstance(out, tuple) else out
        obs = self._cast_obs(self._select(obs))
        return (jnp.asarray(self._handle), jnp.zeros((self.num_envs,), bool)), obs

    def spec(self) -> tuple[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct], Any]:
        """``((handle, reset_pending), obs)`` as ``jax.ShapeDtypeStruct`` s; runs
        nothing."""
        h = jax.ShapeDtypeStruct(self._handle.shape, self._handle.dtype)
        pending = jax.ShapeDtypeStruct((self.num_envs,), jnp.bool_)
        return (h, pending), self._obs_spec

    def step_chunk(self, env_state: tuple, actions: jax.Array, rng: jax.Array):
        """Send the chunk's ``K`` actions one after the other through EnvPool's XLA step.

        Returns:
          ``((handle, reset_pending), obs, rewards [B, K], terminations [B, K],
          truncations [B, K], final_obs, valid [B, K])``: ``valid`` is false on EnvPool's
          reset steps (see the module docstring), where rewards are 0 and flags false.
        """
        del rng
        self._check_x64()
        expect = (self.num_envs, self.actions_per_chunk, *self.action_shape)
        if tuple(actions.shape) != expect:
            raise ValueError(f"EnvPoolXla: actions of shape {actions.shape}, expected {expect}")

        def step(state, k, a):
            handle, pending = state
            a = a.astype(self.action_dtype)
            if self._bounds is not None:
                low, high = (jnp.asarray(b[None], self.action_dtype) for b in self._bounds)
                a = jnp.clip(a, low, high)
            handle, (obs, rew, term, trunc, _info) = self._step(handle, a)
            obs = self._cast_obs(self._select(obs))
            # The step after a done is EnvPool's reset step: its action did not run
            # (EnvPool gives reward 0 and no flags there; kept so, whatever it gives).
            valid = ~pending
            rew = jnp.where(valid, rew.astype(self.reward_dtype), jnp.zeros((), self.reward_dtype))
            term, trunc = term.astype(bool) & valid, trunc.astype(bool) & valid
            return (handle, term | trunc), obs, rew, term, trunc, obs, valid

        return sync.scan_chunk(step, env_state, actions)

    # -- helpers ----------------------------------------------------------------------

    def _obs_out(self, dtype):
        return np.dtype(dtype) if self.obs_dtype is None else np.dtype(self.obs_dtype)

    def _select(self, obs):
        if self.obs_key is None:
            return obs
        keys = self.obs_key if isinstance(self.obs_key, tuple) else (self.obs_key,)
        for k in keys:
            obs = obs[k]
        return obs

    def _cast_obs(self, obs):
        return jax.tree.map(lambda x: jnp.asarray(x, self._obs_out(x.dtype)), obs)

    def _check_x64(self):
        wide = self.action_dtype.itemsize == 8 or any(
            np.dtype(s.dtype).itemsize == 8
            for s in jax.tree.leaves(_space_tree(self.pool.spec.observation_space))
        )
        if wide and not jax.config.read("jax_enable_x64"):
            raise RuntimeError(X64_MESSAGE.format(dtype=self.action_dtype))


def _space_tree(space):
    """A gym(nasium) space -> a pytree of its leaf spaces (``Dict`` spaces as dicts)."""
    sub = getattr(space, "spaces", None)
    if isinstance(sub, dict):
        return {k: _space_tree(v) for k, v in sub.items()}
    return _Leaf(space)


class _Leaf:
    """A leaf space (not a pytree node) with ``shape`` and ``dtype``."""

    def __init__(self, space):
        self.shape, self.dtype = tuple(space.shape), space.dtype
