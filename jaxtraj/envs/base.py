"""What the host adapters share: their base class, their description and the helpers.

- :class:`ChunkEnv`, the base of :class:`~jaxtraj.envs.GymnasiumEnv` and
  :class:`~jaxtraj.envs.EnvPoolEnv`: one action chunk ``[B, K, A]`` executed as up to
  ``K`` steps of a subclass's one-step functions under either ``chunk_end``
  (``"cut"``, ``"continue"``), casting (and, when asked, clipping) at the boundary,
  :meth:`~ChunkEnv.spec` and :meth:`~ChunkEnv.check_against`;
- :class:`EnvSpec`, what an adapter produces and takes, and from it
  :func:`example_parts` (the collector's example halves) and :func:`check_spec` (an
  adapter against the collector's examples);
- the adapters' helpers: :func:`require` (import a simulator's library, or name the
  extra that installs it), :func:`check_chunk_end`, :func:`action_bounds`,
  :func:`space_spec`, :func:`obs_converter` and :func:`cast_obs`.

The public names are importable from :mod:`jaxtraj.envs`. This module imports neither
gymnasium nor EnvPool.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxtraj.types import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)

PyTree = Any


def require(module: str, extra: str, who: str) -> Any:
    """Import ``module``, or raise ImportError naming the jaxtraj extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != module.split(".")[0]:
            raise
        raise ImportError(
            f"{who} needs the {extra} extra (pip install 'jaxtraj[{extra}]'): {e}"
        ) from e


CHUNK_ENDS = ("cut", "continue")


def check_chunk_end(chunk_end: Any, who: str) -> str:
    """``chunk_end`` validated: ``"cut"`` or ``"continue"``, else ValueError naming it."""
    if not isinstance(chunk_end, str) or chunk_end not in CHUNK_ENDS:
        raise ValueError(f"{who}: chunk_end must be 'cut' or 'continue', got {chunk_end!r}")
    return chunk_end


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class EnvSpec:
    """What an adapter produces and takes, as ``jax.ShapeDtypeStruct`` trees (after
    casting): enough to build the collector's example halves without running anything.

    Attributes:
      obs: the observation tree, leaves ``[B, ...]`` (also ``final_obs``'s).
      actions: the action chunk ``[B, K, *action_shape]`` in the action space's dtype
        (what the env executes; a policy may give any dtype that casts to it).
      transition: an :class:`EnvTransition` of rewards, terminations and truncations
        ``[B, K]`` (and ``success`` when asked for, ``valid_actions`` ``[B, K]`` bool
        under ``chunk_end="cut"``).
      action_obs: leaves ``[B, K, ...]`` when the adapter keeps per-action
        observations, else ``None``.
    """

    obs: PyTree
    actions: jax.ShapeDtypeStruct
    transition: EnvTransition
    action_obs: PyTree = None

    @property
    def batch_size(self) -> int:
        return int(self.actions.shape[0])

    @property
    def actions_per_chunk(self) -> int:
        return int(self.actions.shape[1])


def _zeros(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda s: np.zeros(np.shape(s), _dtype(s)), tree)


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def example_parts(
    env: Any, plan: Any, policy_output: PolicyOutput, key: TrajectoryKey | None = None
) -> tuple[PolicyPart, EnvPart]:
    """Zero-filled example halves for ``TrajectoryCollector(plan, policy_example,
    env_example)`` from an adapter's :meth:`spec` and one policy output example.

    Args:
      env: a :class:`GymnasiumEnv` or :class:`~jaxtraj.envs.EnvPoolEnv` (or its
        :class:`EnvSpec`).
      plan: the :class:`~jaxtraj.TrajectoryPlan`; its ``batch_size`` must be the env's.
      policy_output: a :class:`~jaxtraj.PolicyOutput` example (arrays or
        ``jax.ShapeDtypeStruct`` leaves, e.g. from ``jax.eval_shape`` of the policy).
      key: the examples' key (default ``TrajectoryKey(0, 0, 0, 0, 0)``).

    Returns:
      ``(PolicyPart, EnvPart)``: the policy half's observation is the env's (cast);
      the env half is chunk 0's, with ``initial_transition``, ``action_obs`` when the
      env reports per-action observations, and, when the policy output has
      ``prev_values``, ``final_values`` zeros ``[B]`` float32.

    Raises:
      ValueError: the policy's actions or the plan's batch size do not fit the env.
    """
    spec = env if isinstance(env, EnvSpec) else env.spec()
    B = spec.batch_size
    if int(plan.batch_size) != B:
        raise ValueError(f"the plan's batch_size is {plan.batch_size}, the env has {B} envs")
    key = key if key is not None else TrajectoryKey(0, 0, 0, 0, 0)
    src = TrajectorySource(key, B, 0)
    out = _zeros(policy_output)
    policy = PolicyPart(src, _zeros(spec.obs), out)
    _check_actions(spec, out.actions)
    tr = _zeros(spec.transition)
    final = np.zeros((B,), np.float32) if out.prev_values is not None else None
    # Per-action observations when the env reports them (lerobot mode keeps them).
    action_obs = None if spec.action_obs is None else _zeros(spec.action_obs)
    return policy, EnvPart(
        src, tr, initial_transition=tr.boundary(), final_values=final, action_obs=action_obs
    )


def _path_name(path: tuple) -> str:
    parts = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
    return "/".join(parts)


def _describe(x: Any) -> str:
    return f"{tuple(np.shape(x))} {_dtype(x)}"


def _check_tree(name: str, env_tree: PyTree, example: PyTree, *, check_dtype: bool = True):
    """``env_tree`` (the env's, ShapeDtypeStruct leaves) against a collector example."""
    e_leaves, e_def = jax.tree_util.tree_flatten_with_path(env_tree)
    x_leaves, x_def = jax.tree_util.tree_flatten_with_path(example)
    if e_def != x_def:
        names = lambda leaves: [_path_name(p) or "<array>" for p, _ in leaves]
        raise ValueError(
            f"{name}: env gives {names(e_leaves)}, the collector's example has {names(x_leaves)}"
        )
    for (path, e), (_, x) in zip(e_leaves, x_leaves):
        same_dtype = not check_dtype or _dtype(e) == _dtype(x)
        if tuple(np.shape(e)) != tuple(np.shape(x)) or not same_dtype:
            where = _path_name(path)
            label = f"{name} {where!r}" if where else name
            raise ValueError(
                f"{label}: env gives {_describe(e)}, the collector's example has {_describe(x)}"
            )


def _check_actions(spec: EnvSpec, actions: Any) -> None:
    want = spec.actions
    if tuple(np.shape(actions)) != tuple(want.shape):
        B, K = want.shape[:2]
        flat = int(np.prod(np.shape(actions))) == int(np.prod(want.shape))
        raise ValueError(
            f"actions: env takes {tuple(want.shape)} (B={B} envs, a chunk of K={K} actions "
            f"of {tuple(want.shape[2:])}), the example policy output (example_parts', or "
            f"the collector's) has {_describe(actions)}"
            + (f": reshape the policy's actions to [N, {', '.join(map(str, want.shape[1:]))}]"
               if flat else "")
        )


def _strip_lead(tree: PyTree, lead: int) -> PyTree:
    """Buffer leaves ``[*lead, B, ...]`` -> ShapeDtypeStruct ``[B, ...]``."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(tuple(s.shape[lead:]), s.dtype), tree)


def check_spec(spec: EnvSpec, example: Any) -> None:
    """Check an adapter's :class:`EnvSpec` against the collector's examples.

    ``example``: a :class:`~jaxtraj.TrajectoryCollector` (its layout), a
    :class:`~jaxtraj.PolicyPart`, or a ``(PolicyPart, EnvPart)`` pair. Compares the
    observation tree (structure, shapes ``[B, ...]``, dtypes after casting), the action
    chunk's shape (any dtype: actions are cast), and, when an env example is at hand,
    the rewards' and flags' shapes and dtypes.

    Raises:
      ValueError: naming the field and both shapes, e.g. ``observation 'state': env
        gives (4, 11) float32, the collector's example has (4, 17) float32``.
    """
    env_example = None
    if hasattr(example, "layout") and hasattr(example, "plan"):  # a TrajectoryCollector
        lay = example.layout
        obs, actions = _strip_lead(lay.policy.obs, lay.lead), lay.policy.output.actions
        actions = _strip_lead(actions, lay.lead)
        env_example = _strip_lead(lay.env.transition, lay.lead)
    else:
        if isinstance(example, tuple):
            example, env_part = example
            env_example = env_part.transition
        if not isinstance(example, PolicyPart):
            raise TypeError(
                "check_against takes a TrajectoryCollector, a PolicyPart or a "
                f"(PolicyPart, EnvPart) pair, got {type(example).__name__}"
            )
        obs, actions = example.obs, example.output.actions
    _check_tree("observation", spec.obs, obs)
    _check_actions(spec, actions)
    if env_example is not None:
        for field in ("rewards", "terminations", "truncations"):
            want = getattr(env_example, field)
            if want is not None:
                _check_tree(field, getattr(spec.transition, field), want)


# --------------------------------------------------------------------------- chunks


def cast_obs(x: Any, obs_dtype: np.dtype) -> np.ndarray:
    """One observation leaf as a fresh array: floats to ``obs_dtype``, others kept."""
    x = np.asarray(x)
    dtype = obs_dtype if np.issubdtype(x.dtype, np.floating) else x.dtype
    with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN pass through
        return np.array(x, dtype=dtype, copy=True)


def _rows_where(mask: np.ndarray, x: PyTree, y: PyTree) -> PyTree:
    def pick(a, b):
        return np.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, x, y)


def _replace_rows(tree: PyTree, rows: np.ndarray, new: PyTree) -> PyTree:
    """``tree`` with ``rows`` replaced by ``new`` (fresh arrays; ``tree`` untouched)."""

    def one(x, y):
        x = np.array(x, copy=True)
        x[rows] = y
        return x

    return jax.tree.map(one, tree, new)




class ChunkEnv:
    """What the adapters share: chunk execution over a one-step function, casting,
    the spec, the spaces check. Subclasses set the attributes below and implement
    :meth:`_reset_all`, :meth:`_step_once` (``chunk_end="continue"``) and, where they
    can cut a chunk, :meth:`_step_rows` and :meth:`_reset_rows`."""

    num_envs: int
    actions_per_chunk: int
    per_action_obs: bool
    info_keys: tuple[str, ...]
    _obs_spec: PyTree  # ShapeDtypeStruct leaves [B, ...], after casting
    _action_shape: tuple[int, ...]
    _action_dtype: np.dtype
    _action_bounds: tuple[np.ndarray, np.ndarray] | None  # (low, high) when clip_actions
    _reward_dtype: np.dtype
    _convert: Callable[[Any], PyTree]  # the env's observation -> our cast tree

    def _setup(
        self, *, num_envs, obs_space, action_space, obs_is_dict, obs_dtype, obs_key,
        actions_per_chunk, per_action_obs, info_keys, reward_dtype, success=None,
        chunk_end="continue", clip_actions=False,
    ):
        """The options both adapters share, and what the spaces (one sub-env's) imply."""
        self.chunk_end = check_chunk_end(chunk_end, type(self).__name__)
        if int(actions_per_chunk) < 1:
            raise ValueError(f"actions_per_chunk must be >= 1, got {actions_per_chunk}")
        if isinstance(info_keys, str):
            info_keys = (info_keys,)
        if success is not None and (not isinstance(success, str) or not success):
            raise ValueError(
                f"success must be None, 'terminations' or the name of an info entry, got {success!r}"
            )
        self.actions_per_chunk = int(actions_per_chunk)
        self.per_action_obs = bool(per_action_obs)
        self.info_keys = tuple(info_keys)
        self.success = success
        # Info entries read per step: the user's, and the success flag's if it is one.
        extra = () if success in (None, "terminations") or success in self.info_keys else (success,)
        self._kept_keys = self.info_keys + extra
        self._reward_dtype = np.dtype(reward_dtype)
        self._info_dtypes: dict[str, np.dtype] = {}
        self._obs = None
        self.num_envs = int(num_envs)
        self._obs_spec = space_spec(obs_space, self.num_envs, np.dtype(obs_dtype), obs_key)
        self._convert = obs_converter(np.dtype(obs_dtype), obs_key, obs_is_dict)
        self._action_shape = tuple(action_space.shape)
        self._action_dtype = np.dtype(action_space.dtype)
        self.clip_actions = bool(clip_actions)
        self._action_bounds = (
            action_bounds(action_space, type(self).__name__) if self.clip_actions else None
        )

    # ------------------------------------------------------------------ public

    def spec(self) -> EnvSpec:
        """Shapes and dtypes of what this env produces and takes (see :class:`EnvSpec`)."""
        B, K = self.num_envs, self.actions_per_chunk
        flags = jax.ShapeDtypeStruct((B, K), np.dtype(bool))
        transition = EnvTransition(
            rewards=jax.ShapeDtypeStruct((B, K), self._reward_dtype),
            terminations=flags,
            truncations=flags,
            success=None if self.success is None else flags,
            valid_actions=flags if self.chunk_end == "cut" else None,
        )
        action_obs = None
        if self.per_action_obs:
            action_obs = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct((B, K, *s.shape[1:]), s.dtype), self._obs_spec
            )
        return EnvSpec(
            obs=self._obs_spec,
            actions=jax.ShapeDtypeStruct((B, K, *self._action_shape), self._action_dtype),
            transition=transition,
            action_obs=action_obs,
        )

    def check_against(self, example: Any) -> None:
        """Check this env against the collector's examples; see :func:`check_spec`.

        ``example``: the :class:`~jaxtraj.TrajectoryCollector`, a policy example
        :class:`~jaxtraj.PolicyPart`, or a ``(PolicyPart, EnvPart)`` pair.

        Raises:
          ValueError: naming the field and both shapes and dtypes.
        """
        check_spec(self.spec(), example)

    def reset(self) -> PyTree:
        """Reset every environment; the first observation, leaves ``[B, ...]``."""
        self._obs = self._reset_all()
        return self._obs

    def step(self, key: TrajectoryKey | None, actions: Any):
        """Execute one chunk ``[B, K, *action_shape]``; see the adapter's docstring
        (:class:`~jaxtraj.envs.GymnasiumEnv`, :class:`~jaxtraj.envs.EnvPoolEnv`).

        ``key`` names the chunk; it does not change what is executed (randomness is the
        environments' own, continued from their seeds). The actions are cast to the
        action space's dtype and, with ``clip_actions``, clipped to its bounds: that is
        what the simulator receives. The returned ``EnvStep`` does not carry them: the
        collector records the actions given here (the policy's).
        """
        from jaxtraj.runners.service import EnvStep

        if self._obs is None:
            raise RuntimeError(f"{type(self).__name__}.step before reset()")
        B, K = self.num_envs, self.actions_per_chunk
        want = (B, K, *self._action_shape)
        if tuple(np.shape(actions)) != want:
            raise ValueError(
                f"actions: env takes {want} (B={B} envs, a chunk of K={K} actions of "
                f"{self._action_shape}), got {tuple(np.shape(actions))}"
            )
        actions = np.asarray(actions, dtype=self._action_dtype)
        if self._action_bounds is not None:  # what the simulator receives (NaN stays NaN)
            actions = np.clip(actions, *self._action_bounds)
        rewards = np.zeros((B, K), self._reward_dtype)
        terms, truncs = np.zeros((B, K), bool), np.zeros((B, K), bool)
        info = {name: [None] * K for name in self._kept_keys}
        action_obs = [] if self.per_action_obs else None
        if self.chunk_end == "cut":
            obs, final_obs, valid = self._cut_chunk(actions, rewards, terms, truncs, info, action_obs)
        else:
            obs, final_obs = self._continue_chunk(actions, rewards, terms, truncs, info, action_obs)
            valid = None
        self._obs = obs
        if action_obs is not None:
            action_obs = jax.tree.map(lambda *xs: np.stack(xs, axis=1), *action_obs)
        stacked = self._stack_info(info) if self._kept_keys else {}
        success = None
        if self.success == "terminations":
            success = terms.copy()
        elif self.success is not None:
            success = stacked[self.success] != 0
        return EnvStep(
            transition=EnvTransition(
                rewards=rewards,
                terminations=terms,
                truncations=truncs,
                success=success,
                valid_actions=valid,
            ),
            obs=obs,
            final_obs=final_obs,
            action_obs=action_obs,
            info={n: stacked[n] for n in self.info_keys} if self.info_keys else None,
        )

    def _continue_chunk(self, actions, rewards, terms, truncs, info, action_obs):
        """Every action executed, ended environments reset at once -> ``(obs, final_obs)``;
        fills ``rewards``, ``terms``, ``truncs``, ``info`` and ``action_obs`` in place."""
        obs = self._obs
        final, ended = None, np.zeros((self.num_envs,), bool)
        for k in range(self.actions_per_chunk):
            if action_obs is not None:
                action_obs.append(obs)
            obs, r, term, trunc, last, inf = self._step_once(actions[:, k])
            with np.errstate(over="ignore", invalid="ignore"):
                rewards[:, k] = r
            terms[:, k], truncs[:, k] = term, trunc
            done = term | trunc
            if done.any():  # the first episode end of the chunk is its final_obs
                first = done & ~ended
                final = last if final is None else _rows_where(first, last, final)
                ended |= done
            for name in self._kept_keys:
                info[name][k] = inf.get(name)
        final_obs = obs if final is None else _rows_where(ended, final, obs)
        return obs, final_obs

    def _cut_chunk(self, actions, rewards, terms, truncs, info, action_obs):
        """Only live environments step; an ended one pads the rest of the chunk and is
        reset at its end -> ``(obs, final_obs, valid_actions [B, K])``; fills the rest in
        place (padding slots stay zero)."""
        B, K = self.num_envs, self.actions_per_chunk
        obs = self._obs
        live = np.ones((B,), bool)
        valid = np.zeros((B, K), bool)
        for k in range(K):
            if action_obs is not None:  # padding slots: the observation the episode ended on
                action_obs.append(obs)
            rows = np.flatnonzero(live)
            if rows.size == 0:
                continue
            o, r, term, trunc, inf = self._step_rows(rows, actions[rows, k])
            term, trunc = np.asarray(term, bool), np.asarray(trunc, bool)
            valid[rows, k] = True
            with np.errstate(over="ignore", invalid="ignore"):
                rewards[rows, k] = r
            terms[rows, k], truncs[rows, k] = term, trunc
            obs = o if rows.size == B else _replace_rows(obs, rows, o)
            live[rows[term | trunc]] = False
            for name in self._kept_keys:
                got = inf.get(name)
                if got is not None:
                    values, present = np.asarray(got[0]), np.asarray(got[1], bool)
                    full = np.zeros((B,), values.dtype)
                    full[rows] = values
                    seen = np.zeros((B,), bool)
                    seen[rows] = present
                    info[name][k] = (full, seen)
        final_obs = obs
        ended = np.flatnonzero(~live)
        if ended.size:
            obs = _replace_rows(obs, ended, self._reset_rows(ended))
        return obs, final_obs, valid

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ helpers

    def _stack_info(self, info: dict[str, list]) -> dict[str, np.ndarray]:
        """Per-action ``(values [B], present [B])`` -> ``[B, K]``, zero where absent.

        A key keeps the dtype it first came with; never seen: float32 zeros.
        """
        B, K = self.num_envs, self.actions_per_chunk
        out = {}
        for name, per_action in info.items():
            for got in per_action:
                if got is not None and name not in self._info_dtypes:
                    self._info_dtypes[name] = np.asarray(got[0]).dtype
            arr = np.zeros((B, K), self._info_dtypes.get(name, np.dtype(np.float32)))
            for k, got in enumerate(per_action):
                if got is not None:
                    values, present = got
                    arr[present, k] = np.asarray(values)[present]
            out[name] = arr
        return out

    def _reset_all(self) -> PyTree:
        raise NotImplementedError

    def _step_once(self, actions: np.ndarray) -> tuple:
        """``chunk_end="continue"``: one step of every env -> ``(obs, rewards [B],
        terminations [B], truncations [B], last_obs, info)``: ``obs`` after resetting the
        ended envs, ``last_obs`` the step's observation before any reset (read on ended
        rows), and ``info`` ``{name: (values [B], present [B] bool)}`` for the kept info
        keys."""
        raise NotImplementedError

    def _step_rows(self, rows: np.ndarray, actions: np.ndarray) -> tuple:
        """``chunk_end="cut"``: one step of the envs ``rows`` (ascending), no reset ->
        ``(obs [n, ...], rewards [n], terminations [n], truncations [n], info)`` with
        ``info`` ``{name: (values [n], present [n] bool)}``."""
        raise NotImplementedError

    def _reset_rows(self, rows: np.ndarray) -> PyTree:
        """``chunk_end="cut"``: reset the envs ``rows`` (ascending, no seed: their random
        streams continue) -> their cast observations ``[n, ...]``."""
        raise NotImplementedError


def action_bounds(space: Any, who: str) -> tuple[np.ndarray, np.ndarray]:
    """A Box-like single-env action space's ``(low, high)``, each shaped like one action
    in the space's dtype: what ``clip_actions`` clips to.

    Raises:
      ValueError: the space has no ``low`` and ``high`` (a ``Discrete`` space, ...).
    """
    low, high = getattr(space, "low", None), getattr(space, "high", None)
    if low is None or high is None or getattr(space, "shape", None) is None:
        raise ValueError(
            f"{who}: clip_actions needs a Box action space (low and high bounds), got {space!r}"
        )
    shape, dtype = tuple(space.shape), np.dtype(space.dtype)
    return (
        np.broadcast_to(np.asarray(low, dtype), shape).copy(),
        np.broadcast_to(np.asarray(high, dtype), shape).copy(),
    )


def space_spec(space: Any, batch: int, obs_dtype: np.dtype, obs_key: str | None) -> PyTree:
    """A single-env observation space -> ShapeDtypeStruct tree ``[B, ...]`` after casting.

    A Box-like space (``shape`` and ``dtype``) becomes ``{obs_key: leaf}`` (the leaf
    alone when ``obs_key`` is ``None``); a Dict-like space (``spaces``) a dict.
    """

    def one(s, path):
        subspaces = getattr(s, "spaces", None)
        if isinstance(subspaces, dict) or (subspaces is not None and hasattr(subspaces, "items")):
            return {k: one(v, f"{path}/{k}") for k, v in subspaces.items()}
        if subspaces is not None or getattr(s, "shape", None) is None or s.dtype is None:
            raise ValueError(
                f"observation space {path or ''}{s!r}: only Box-like (shape, dtype) and Dict "
                "spaces are supported"
            )
        dtype = np.dtype(s.dtype)
        dtype = np.dtype(obs_dtype) if np.issubdtype(dtype, np.floating) else dtype
        return jax.ShapeDtypeStruct((batch, *s.shape), dtype)

    tree = one(space, "")
    if not isinstance(tree, dict) and obs_key is not None:
        tree = {obs_key: tree}
    return tree


def obs_converter(obs_dtype: np.dtype, obs_key: str | None, is_dict: bool) -> Callable:
    """The env's observation (array or nested mapping) -> our cast tree of fresh arrays."""
    obs_dtype = np.dtype(obs_dtype)

    def conv(x):
        if hasattr(x, "items"):
            return {k: conv(v) for k, v in x.items()}
        return cast_obs(x, obs_dtype)

    if is_dict or obs_key is None:
        return conv
    return lambda x: {obs_key: conv(x)}
