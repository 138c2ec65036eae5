"""The synchronous runner: environment, policy and collector in one jitted ``lax.scan``.

For JAX environments in gymnax's style (``env.reset(key, params) -> (obs, state)``,
``env.step(key, state, action, params)``, auto-resetting), vmapped over ``B``
environments, or for a batched env driver (:class:`EnvDriver`, e.g.
:class:`jaxtraj.envs.envpool_xla.EnvPoolXla`, EnvPool's MuJoCo stepped through its XLA
interface inside the same scan): every function below takes either as ``env``. One
call of :func:`collect` runs a whole training step of one source: for each of ``E`` epochs and ``T`` chunks it

1. runs policy inference, ``policy_fn(params, obs, rng) -> PolicyOutput`` (actions
   ``[B, K, A]``, ``prev_logprobs``, ``prev_values [B]``); ``rng`` is ``[B, 2]``, a PRNG
   key per row: the chunk's policy key split with
   :func:`~jaxtraj.runners.service.row_rngs`, the host runners' signature and rule
   (:data:`~jaxtraj.runners.service.PolicyFn`), so one policy serves every runner;
2. executes the ``K`` actions of the chunk in the environments (see "Chunk ends"
   below);
3. runs terminal inference, ``value_fn(params, final_obs) -> [B]``: ``V`` of the
   observation the chunk's first episode end left where an episode ended in the chunk,
   else of the current observation (on the last chunk, the bootstrap ``V(s_T)``);
4. builds the chunk's ``PolicyPart`` and ``EnvPart`` under
   ``TrajectoryKey(step_id, epoch, env_rank, stage_id, chunk)`` (chunk 0 carries
   ``initial_transition``: the flags of the chunk before it) and inserts them with
   :func:`jaxtraj.add_policy` / :func:`jaxtraj.add_env`.

Everything is traced once; with :func:`make_collect` a training step of collection
is one compiled call with the collector state donated.

Chunk ends (``chunk_end``, an argument of :func:`collect`, :func:`make_collect`,
:func:`rollout_stacked` and :func:`example_parts`; give all of them the same). For a
gymnax-style environment:

- ``"cut"`` (the default): an environment whose episode ends at action ``k`` is frozen
  for the rest of the chunk: its env state and observation stay the post-reset ones
  gymnax's auto-reset gave at action ``k`` (a ``jnp.where`` per row), so the next chunk
  starts the new episode; slots ``k + 1 ..`` are padding (``valid_actions`` false,
  reward 0, flags false). The env half carries ``valid_actions [B, K]``.
- ``"continue"``: every action runs; the environment auto-resets at once and runs
  actions ``k + 1 ..`` in the new episode (not part of the ended chunk's return); no
  ``valid_actions``.

Both step every environment with the same keys (action ``k`` with
``jax.random.split(jax.random.fold_in(rng, k), B)``; a frozen row's step is computed and
dropped), so ``"continue"`` gives the same trajectories as before the option existed.
An :class:`EnvDriver` decides for itself (its ``chunk_end`` attribute, its
``step_chunk``'s ``valid``): leave ``chunk_end`` ``None`` or give the driver's.

Terminations and truncations: gymnax >= 1.0's ``step`` returns
``(obs, state, reward, terminated, truncated, info)`` with the pre-reset observation in
``info["final_observation"]``; the runner uses them (a time limit is a truncation and
bootstraps from ``V(final obs)``). An older five-tuple ``step``
``(obs, state, reward, done, info)`` gives no truncation signal: ``done`` is then
treated as a termination (``info["truncated"]`` / ``info["final_observation"]`` are
used if the environment provides them).

:func:`rollout_stacked` runs the same rollout but only stacks the parts with
``lax.scan`` (no collector): the baseline that ``benchmarks/rollout.py`` compares with.

Env drivers. An object with ``step_chunk`` is taken as an :class:`EnvDriver` (its
``env_params`` argument is then ignored: pass ``None``): ``init(rng) -> (env_state,
obs)`` starts ``num_envs`` environments (may run on the host, outside ``jit``),
``spec()`` gives the shapes and dtypes of ``init``'s results without running anything,
and ``step_chunk(env_state, actions [B, K, A], rng) -> (env_state, obs, rewards [B, K],
terminations [B, K], truncations [B, K], final_obs[, valid])`` executes a chunk,
traceable; the optional seventh element ``valid [B, K]`` bool (or ``None``) becomes the
env half's ``EnvTransition.valid_actions``. A gymnax environment is wrapped in the same
protocol internally (:class:`GymnaxDriver`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxtraj import checks, joiner
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.state import CollectorState
from jaxtraj.types import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)

PolicyFn = Callable[[Any, Any, jax.Array], PolicyOutput]
ValueFn = Callable[[Any, Any], jax.Array]


@struct.dataclass
class EnvCarry:
    """What the runner carries between chunks and training steps.

    Attributes:
      env_state: the vmapped environment state, leaves ``[B, ...]``.
      obs: the current observation, leaves ``[B, ...]``.
      terminations, truncations: ``[B, K]`` bool, flags of the last executed chunk
        (chunk 0's ``initial_transition``; all false after :func:`reset`).
      rng: the runner's PRNG key.
    """

    env_state: Any
    obs: Any
    terminations: jax.Array
    truncations: jax.Array
    rng: jax.Array


@runtime_checkable
class EnvDriver(Protocol):
    """``B`` batched environments that execute whole chunks: what the runner steps.

    Attributes:
      num_envs: ``B``.
      actions_per_chunk: ``K``.
    """

    num_envs: int
    actions_per_chunk: int

    # Optional: ``chunk_end``, "cut" or "continue", what the driver does after an
    # episode ends inside a chunk (read by the runner to check its ``chunk_end``).

    def init(self, rng: jax.Array) -> tuple[Any, Any]:
        """Start the environments -> ``(env_state, obs [B, ...])``; may run on the host."""
        ...

    def spec(self) -> tuple[Any, Any]:
        """``(env_state, obs)`` as ``jax.ShapeDtypeStruct`` pytrees; runs nothing."""
        ...

    def step_chunk(self, env_state: Any, actions: jax.Array, rng: jax.Array) -> tuple:
        """Execute ``actions [B, K, A]`` (traceable) -> ``(env_state, obs, rewards [B, K],
        terminations [B, K], truncations [B, K], final_obs[, valid])``; ``final_obs``:
        per environment, the observation its first episode end in the chunk left, else
        the new observation; ``valid [B, K]`` bool: the actions that ran (``None`` or
        absent: all of them)."""
        ...


def is_driver(env: Any) -> bool:
    """Whether ``env`` is an :class:`EnvDriver` (else a gymnax-style environment)."""
    return hasattr(env, "step_chunk") and hasattr(env, "init")


class GymnaxDriver:
    """A gymnax-style environment vmapped over ``num_envs``, as an :class:`EnvDriver`.

    ``init`` and ``step_chunk`` are traceable; the runner builds one of these from
    ``(env, env_params)`` inside its trace, so ``env_params`` may be traced.
    ``chunk_end``: ``"cut"`` (default) or ``"continue"``, see the module docstring.
    """

    def __init__(
        self,
        env: Any,
        env_params: Any,
        num_envs: int,
        actions_per_chunk: int,
        chunk_end: str = "cut",
    ):
        self.env, self.env_params = env, env_params
        self.num_envs, self.actions_per_chunk = num_envs, actions_per_chunk
        self.chunk_end = _check_chunk_end(chunk_end)

    def init(self, rng: jax.Array):
        obs, env_state = jax.vmap(self.env.reset, in_axes=(0, None))(
            jax.random.split(rng, self.num_envs), self.env_params
        )
        # Strong dtypes (a reset may give weak-typed leaves that a step does not): the
        # carry keeps one structure across calls, so a jitted collect never retraces.
        strong = lambda x: jnp.asarray(x, dtype=jnp.result_type(x))
        return jax.tree.map(strong, (env_state, obs))

    def spec(self):
        return jax.eval_shape(self.init, jax.random.PRNGKey(0))

    def step_chunk(self, env_state: Any, actions: jax.Array, rng: jax.Array):
        return _gymnax_chunk(
            self.env, self.env_params, env_state, actions, rng, chunk_end=self.chunk_end
        )


def _check_chunk_end(chunk_end: Any) -> str:
    if not isinstance(chunk_end, str) or chunk_end not in ("cut", "continue"):
        raise ValueError(f"chunk_end must be 'cut' or 'continue', got {chunk_end!r}")
    return chunk_end


def _driver(
    env: Any, env_params: Any, num_envs: int, actions_per_chunk: int, chunk_end: Any = None
) -> EnvDriver:
    if not is_driver(env):
        mode = "cut" if chunk_end is None else chunk_end
        return GymnaxDriver(env, env_params, num_envs, actions_per_chunk, mode)
    if (env.num_envs, env.actions_per_chunk) != (num_envs, actions_per_chunk):
        raise ValueError(
            f"the env driver steps {env.num_envs} envs x {env.actions_per_chunk} actions "
            f"per chunk; the runner was asked for {num_envs} x {actions_per_chunk}"
        )
    own = getattr(env, "chunk_end", None)
    if chunk_end is not None:
        _check_chunk_end(chunk_end)
        if own is not None and own != chunk_end:
            raise ValueError(
                f"chunk_end={chunk_end!r}, but the env driver {type(env).__name__} does "
                f"chunk_end={own!r} (a driver decides for itself: leave chunk_end None)"
            )
    return env


def reset(env: Any, env_params: Any, rng: jax.Array, num_envs: int, actions_per_chunk: int):
    """Reset ``num_envs`` environments.

    ``env`` is a gymnax-style environment or an :class:`EnvDriver` (``env_params``
    ignored; its ``num_envs`` and ``actions_per_chunk`` must match). An EnvPool driver
    resets its pool on the host here: call it outside ``jit``.

    Returns:
      An :class:`EnvCarry` with obs ``[B, ...]``, no flags set, and a fresh key. Leaves
      have strong dtypes, as :func:`collect` returns them.
    """
    rng, sub = jax.random.split(rng)
    env_state, obs = _driver(env, env_params, num_envs, actions_per_chunk).init(sub)
    flags = jnp.zeros((num_envs, actions_per_chunk), bool)
    return EnvCarry(env_state, obs, flags, flags, rng)


def _env_step(env, env_params, key, env_state, action):
    """One gymnax step of one environment -> ``(obs, state, r, term, trunc, final_obs)``."""
    out = env.step(key, env_state, action, env_params)
    if len(out) == 6:
        obs, env_state, reward, term, trunc, info = out
    else:  # five-tuple: done is a termination unless the env says otherwise
        obs, env_state, reward, done, info = out
        trunc = info.get("truncated", jnp.zeros_like(done)) if isinstance(info, dict) else False
        trunc = jnp.asarray(trunc, bool)
        term = jnp.logical_and(done, ~trunc)
    final = info.get("final_observation", obs) if isinstance(info, dict) else obs
    return obs, env_state, reward, jnp.asarray(term, bool), jnp.asarray(trunc, bool), final


def step_chunk(
    env: Any,
    env_params: Any,
    env_state: Any,
    obs: Any,
    actions: jax.Array,
    rng,
    *,
    chunk_end: str = "continue",
):
    """Execute a chunk of actions in ``B`` auto-resetting gymnax environments.

    Args:
      actions: ``[B, K, A]``; action ``k`` of every environment is stepped with key
        ``jax.random.split(jax.random.fold_in(rng, k), B)``.
      obs: the current observation (unused: kept for the signature).
      chunk_end: ``"continue"`` (default here, the auto-resetting chunk) or ``"cut"``
        (an ended environment is frozen for the rest of the chunk).

    Returns:
      ``(env_state, obs, rewards [B, K], terminations [B, K], truncations [B, K],
      final_obs)`` (and ``valid [B, K]`` under ``"cut"``): ``final_obs`` is, per
      environment, the observation before its first reset in the chunk if an episode
      ended, else the new observation.
    """
    del obs
    return _gymnax_chunk(env, env_params, env_state, actions, rng, chunk_end=chunk_end)


def _rows_where(rows, x, y):
    """Per row (leading axis ``B``) of every leaf: ``x`` where ``rows``, else ``y``."""
    return jax.tree.map(
        lambda a, b: jnp.where(rows.reshape(rows.shape + (1,) * (a.ndim - 1)), a, b), x, y
    )


def scan_chunk(step: Callable, env_state: Any, actions: jax.Array, *, chunk_end: str = "continue"):
    """Execute ``actions [B, K, A]`` one action at a time in a ``lax.scan``.

    A helper for writing an :class:`EnvDriver`'s ``step_chunk``.

    Args:
      step: ``(env_state, k, actions_k [B, A]) -> (env_state, obs, rewards [B],
        terminations [B], truncations [B], last_obs[, valid [B]])``; ``last_obs`` is the
        observation an episode ended on (read only where one ended); ``k`` is the
        action's index; the optional ``valid`` says which environments executed the
        action (EnvPool's reset step does not).
      chunk_end: ``"continue"``: every step's results are kept. ``"cut"``: a row whose
        episode ended keeps the env state and observation of that step (the post-reset
        ones of an auto-resetting env) for the rest of the chunk, with reward 0, flags
        false and ``valid`` false there; every leaf of ``env_state`` must then be
        ``[B, ...]``.

    Returns:
      ``(env_state, obs, rewards [B, K], terminations [B, K], truncations [B, K],
      final_obs)``, and ``valid [B, K]`` bool when ``step`` gives ``valid`` or under
      ``"cut"``: ``final_obs`` is, per environment, the observation its first episode
      end in the chunk left if one ended, else the new observation.
    """
    _check_chunk_end(chunk_end)
    cut = chunk_end == "cut"
    K, B = actions.shape[1], actions.shape[0]
    xs = (jnp.arange(K, dtype=jnp.int32), jnp.swapaxes(actions, 0, 1))
    # The carried observations start as zeros of the step's shapes (computed abstractly,
    # nothing runs); the first action overwrites obs, an episode's end overwrites final.
    shapes = jax.eval_shape(step, env_state, xs[0][0], xs[1][0])
    zeros = lambda t: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), t)
    gives_valid = len(shapes) > 6 and shapes[6] is not None
    has_valid = gives_valid or cut

    def one(carry, x):
        env_state, obs, final, ended = carry
        out = step(env_state, *x)
        new_state, new_obs, r, term, trunc, last = out[:6]
        valid = jnp.asarray(out[6], bool) if gives_valid else jnp.ones((B,), bool)
        term, trunc = jnp.asarray(term, bool), jnp.asarray(trunc, bool)
        if cut:  # an ended row stays as its end left it: no step, nothing recorded
            live = ~ended
            new_state = _rows_where(live, new_state, env_state)
            new_obs = _rows_where(live, new_obs, obs)
            r = jnp.where(live, r, jnp.zeros_like(r))
            term, trunc, valid = term & live, trunc & live, valid & live
        done = term | trunc
        final = _rows_where(done & ~ended, last, final)  # the chunk's first end
        return (new_state, new_obs, final, ended | done), (r, term, trunc, valid)

    init = (env_state, zeros(shapes[1]), zeros(shapes[5]), jnp.zeros((B,), bool))
    (env_state, obs, final, ended), (r, term, trunc, valid) = lax.scan(one, init, xs)
    final = _rows_where(ended, final, obs)
    if has_valid:
        return env_state, obs, r.T, term.T, trunc.T, final, valid.T
    return env_state, obs, r.T, term.T, trunc.T, final


def _gymnax_chunk(
    env: Any, env_params: Any, env_state: Any, actions: jax.Array, rng, chunk_end="continue"
):
    vstep = jax.vmap(lambda k, s, a: _env_step(env, env_params, k, s, a))
    B = actions.shape[0]

    def step(env_state, k, a):
        obs, env_state, r, term, trunc, last = vstep(
            jax.random.split(jax.random.fold_in(rng, k), B), env_state, a
        )
        return env_state, obs, r, term, trunc, last

    return scan_chunk(step, env_state, actions, chunk_end=chunk_end)


def _chunk(
    env, env_params, policy_fn, value_fn, params, carry, key: TrajectoryKey, first, chunk_end
):
    """One chunk: inference, execution, terminal inference -> ``(carry, policy, env)``."""
    rng, k_pol, k_env = jax.random.split(carry.rng, 3)
    B = carry.terminations.shape[0]
    # int32 like the key (a Python int would be int64 under jax_enable_x64)
    source = TrajectorySource(key, jnp.int32(B), jnp.int32(0))
    out = policy_fn(params, carry.obs, jax.random.split(k_pol, B))  # a key per row (row_rngs)
    driver = _driver(env, env_params, B, carry.terminations.shape[1], chunk_end)
    result = driver.step_chunk(carry.env_state, out.actions, k_env)
    env_state, obs, r, term, trunc, final_obs = result[:6]
    valid = result[6] if len(result) > 6 else None
    initial = None
    if first:  # the boundary before the first action: the previous chunk's flags
        initial = EnvTransition(terminations=carry.terminations, truncations=carry.truncations)
    policy_part = PolicyPart(source=source, obs=carry.obs, output=out)
    env_part = EnvPart(
        source=source,
        transition=EnvTransition(
            rewards=r, terminations=term, truncations=trunc, valid_actions=valid
        ),
        initial_transition=initial,
        final_values=value_fn(params, final_obs),
    )
    return EnvCarry(env_state, obs, term, trunc, rng), policy_part, env_part


def _check_32bit(state: CollectorState) -> None:
    """Under ``jax_enable_x64``, refuse 64-bit buffers with a clear error (at trace time).

    With x64 on, JAX's defaults widen (``jnp.zeros(n)``, a NumPy float64 scalar in an
    expression), so a policy that does not fix its dtypes yields float64 parts and a
    float64 plan; the collector's inserts support 32-bit buffers only under x64.
    """
    if not jax.config.read("jax_enable_x64"):
        return
    wide = [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(state)
        if np.dtype(x.dtype).itemsize == 8
    ]
    if wide:
        raise TypeError(
            "with jax_enable_x64 on, the collector's buffers must be 32-bit (or narrower); "
            f"64-bit buffers: {', '.join(wide[:6])}{' ...' if len(wide) > 6 else ''}. Give "
            "the policy's outputs and values explicit dtypes (e.g. jnp.float32) before "
            "building the example parts"
        )


def _key(step_id, epoch, env_rank, stage_id, chunk) -> TrajectoryKey:
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return TrajectoryKey(i32(step_id), i32(epoch), i32(env_rank), i32(stage_id), i32(chunk))


def _step_id(state: CollectorState, env_rank, stage_id) -> jax.Array:
    if not state.stacked:
        return state.step
    return state.step[checks.locate(jnp, state.sources, env_rank, stage_id)[1]]


def collect(
    plan: TrajectoryPlan,
    env: Any,
    env_params: Any,
    policy_fn: PolicyFn,
    value_fn: ValueFn,
    state: CollectorState,
    carry: EnvCarry,
    params: Any,
    *,
    env_rank: Any = 0,
    stage_id: Any = 0,
    chunk_end: str | None = None,
) -> tuple[CollectorState, EnvCarry]:
    """Collect one training step (``E`` epochs of ``T`` chunks) of one source.

    Pure and traceable: jit it (or use :func:`make_collect`) with ``state`` donated.

    Args:
      plan: the static plan (``num_epochs`` ``E``, ``num_chunks`` ``T``,
        ``batch_size`` ``B``).
      env: a gymnax-style environment (static), or an :class:`EnvDriver`.
      env_params: its parameters (traced; ignored with an :class:`EnvDriver`).
      policy_fn: ``(params, obs [B, ...], rng [B, 2]) -> PolicyOutput`` with ``actions
        [B, K, A]``, ``prev_logprobs`` and ``prev_values [B]``; ``rng``: a PRNG key per
        row, the chunk's policy key split into ``B``
        (:data:`~jaxtraj.runners.service.PolicyFn`).
      value_fn: ``(params, obs [B, ...]) -> [B]``, terminal inference.
      state: the collector state (single-source or stacked); the key's ``step_id``
        is the source's current step in it.
      carry: the :class:`EnvCarry` after :func:`reset` or the previous call.
      params: policy/value parameters passed to ``policy_fn`` and ``value_fn``.
      env_rank: the env rank of the source this rollout feeds.
      stage_id: the stage of that source.
      chunk_end: ``"cut"`` (default for a gymnax-style env) or ``"continue"``; see the
        module docstring (an env driver's own by default). The example parts must be
        built with the same (:func:`example_parts`).

    Returns:
      ``(state, carry)``: the state with every chunk of the step inserted (check
      ``state.error_code`` outside ``jit``) and the carry after the last chunk.
    """
    _check_32bit(state)
    step_id = _step_id(state, env_rank, stage_id)
    run = lambda c, k, first: _chunk(
        env, env_params, policy_fn, value_fn, params, c, k, first, chunk_end
    )

    def insert(st, policy_part, env_part):
        st = joiner.add_policy(plan, st, policy_part)
        return joiner.add_env(plan, st, env_part)

    def epoch(inner, e):
        st, c = inner
        c, p, v = run(c, _key(step_id, e, env_rank, stage_id, 0), True)
        st = insert(st, p, v)

        def chunk(inner, t):
            st, c = inner
            c, p, v = run(c, _key(step_id, e, env_rank, stage_id, t), False)
            return (insert(st, p, v), c), None

        return lax.scan(chunk, (st, c), jnp.arange(1, plan.num_chunks))[0], None

    return lax.scan(epoch, (state, carry), jnp.arange(plan.num_epochs))[0]


def rollout_stacked(
    plan: TrajectoryPlan,
    env: Any,
    env_params: Any,
    policy_fn: PolicyFn,
    value_fn: ValueFn,
    carry: EnvCarry,
    params: Any,
    *,
    step_id: Any = 0,
    env_rank: Any = 0,
    stage_id: Any = 0,
    chunk_end: str | None = None,
) -> tuple[tuple[PolicyPart, EnvPart], tuple[PolicyPart, EnvPart], EnvCarry]:
    """The same rollout as :func:`collect` with the parts only stacked, no collector
    (``chunk_end`` as for :func:`collect`).

    Returns:
      ``(first, rest, carry)``: chunk 0's ``(PolicyPart, EnvPart)`` with leaves
      ``[E, B, ...]``, chunks ``1..T-1`` with leaves ``[E, T-1, B, ...]``, and the carry.
      Same keys, same random numbers, same data as :func:`collect` inserts.
    """
    run = lambda c, k, first: _chunk(
        env, env_params, policy_fn, value_fn, params, c, k, first, chunk_end
    )

    def epoch(c, e):
        c, p0, v0 = run(c, _key(step_id, e, env_rank, stage_id, 0), True)

        def chunk(c, t):
            c, p, v = run(c, _key(step_id, e, env_rank, stage_id, t), False)
            return c, (p, v)

        c, rest = lax.scan(chunk, c, jnp.arange(1, plan.num_chunks))
        return c, ((p0, v0), rest)

    carry, (first, rest) = lax.scan(epoch, carry, jnp.arange(plan.num_epochs))
    return first, rest, carry


def example_parts(
    env: Any,
    env_params: Any,
    policy_fn: PolicyFn,
    value_fn: ValueFn,
    params: Any,
    num_envs: int,
    actions_per_chunk: int,
    *,
    chunk_end: str | None = None,
) -> tuple[PolicyPart, EnvPart]:
    """Zero-filled example halves (chunk 0's env half) for :func:`jaxtraj.init`.

    Shapes and dtypes come from ``jax.eval_shape`` of one chunk; nothing runs (an env
    driver's ``spec`` gives the carry's shapes: an EnvPool pool is not reset here).
    ``chunk_end`` as for :func:`collect` (under ``"cut"`` the env half has
    ``valid_actions``): give both the same.
    """

    driver = _driver(env, env_params, num_envs, actions_per_chunk, chunk_end)
    flags = jax.ShapeDtypeStruct((num_envs, actions_per_chunk), jnp.bool_)
    abstract = EnvCarry(*driver.spec(), flags, flags, jax.eval_shape(jax.random.PRNGKey, 0))

    def one(carry):
        _, p, v = _chunk(
            env, env_params, policy_fn, value_fn, params, carry, _key(0, 0, 0, 0, 0), True,
            chunk_end,
        )
        return p, v

    shapes = jax.eval_shape(one, abstract)
    # numpy zeros: host examples, as jaxtraj.init expects them.
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def make_collect(
    plan: TrajectoryPlan,
    env: Any,
    env_params: Any,
    policy_fn: PolicyFn,
    value_fn: ValueFn,
    *,
    env_rank: int = 0,
    stage_id: int = 0,
    chunk_end: str | None = None,
):
    """``jax.jit`` of :func:`collect` bound to its static arguments, state donated
    (``chunk_end`` as for :func:`collect`).

    Returns:
      ``fn(state, carry, params) -> (state, carry)``: one compiled call per training step.
    """

    def fn(state, carry, params):
        return collect(
            plan,
            env,
            env_params,
            policy_fn,
            value_fn,
            state,
            carry,
            params,
            env_rank=env_rank,
            stage_id=stage_id,
            chunk_end=chunk_end,
        )

    return jax.jit(fn, donate_argnums=0)
