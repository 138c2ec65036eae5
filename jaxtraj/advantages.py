"""Advantage and return kernels: GAE, discounted returns, normalisation, GRPO groups.

Every kernel is a pure, time-major function of arrays: time is the leading axis and any
trailing batch shape is carried along, so one call covers ``[T, B]``, ``[T, E, B]`` or a
``vmap`` over sources. Shapes and dtypes are checked at trace time (free under ``jit``) and
bad input raises ``ValueError`` naming the argument, never an XLA error.

Temporal layout (``DESIGN.md``, "Temporal layout and advantage semantics")::

    rewards  r_t       [T, ...]     t = 0 .. T-1, the reward of action t
    values   v_t       [T+1, ...]   t = 0 .. T;   v_T bootstraps the last step
    dones    d_t       [T+1, ...]   d_0: the state before the first action was terminal;
                                    d_{t+1}: the episode ended with action t

The recurrence (RLinf's)::

    delta_t = r_t + gamma * v_{t+1} * (1 - d_{t+1}) - v_t
    A_t     = delta_t + gamma * lam * (1 - d_{t+1}) * A_{t+1},      A_T = 0
    R_t     = A_t + v_t

A truncated episode bootstraps through its reward: the chunk's training reward
(``EnvTransition.chunk_rewards``) adds ``gamma * V(final obs)`` (per action: discounted to the
action after the end), and the done flag then stops the trace.
A done is applied with a select, not a multiply, so whatever lies after a done (padding,
NaN from a reset environment) never reaches the steps before it.

Formulations (``method=``), all equal to a NumPy loop up to float32 round-off:

``"inplace"``
    One fused, multi-threaded pass writes ``delta`` straight into the advantage buffer; a
    reverse ``fori_loop`` then updates that buffer in place, ``A[t] += c_t * A[t+1]``, each
    step one small kernel that reads two rows and a row of dones and writes one row (no
    separate carry, no zero-initialised output); a last fused pass forms the returns. No
    ``[T, ...]``-sized temporary is allocated besides the two outputs.
``"scan"``
    A reverse ``lax.scan`` over ``(delta_t, done_{t+1})`` with the running advantage as
    carry: the textbook form (Brax, PureJaxRL, rlax). XLA copies the sliced dones, keeps
    the carry apart and stacks the rows into zero-initialised outputs.
``"associative"``
    ``lax.associative_scan`` over the affine maps ``x -> delta_t + c_t * x``, composed in
    pairs ``(c, b) . (c', b') = (c c', b + c b')``: depth ``log2 T`` instead of ``T``, at
    the cost of ``O(log T)`` passes over memory and ``O(T log T)`` work.

``method="auto"`` is resolved at trace time (``resolve_method``) from the backend and the
width ``N`` (the number of trajectories, the product of the batch shape):

* CPU, ``N >= 8``: ``"inplace"``. XLA:CPU runs a loop body as a chain of small
  single-threaded kernels, so a sequential sweep costs the bytes each step moves, while
  whole-array element-wise passes outside the loop run on all cores. Moving ``delta`` and
  the returns out of the loop and updating one buffer in place leaves the loop the least
  traffic. ``benchmarks/gae.py`` times it warm (inputs in cache) and cold (caches flushed
  and inputs not the last call's, as between a rollout and an update); results are in
  ``benchmarks/results/gae.json``.
* CPU, ``N < 8``: ``"scan"``. A row is a few floats, so every step is fixed cost; over
  long ``T`` the in-place loop's separate row reads cost more than the scan's one
  slice per input, and below 8 trajectories the scan is as fast or faster, warm and cold.
* GPU and TPU: ``"associative"``: every sequential step costs a kernel launch or a loop
  trip, which the ``log2 T``-deep associative scan avoids. ``benchmarks/gpu.sh`` times all
  three; pass ``method=`` to choose one.

What lost on CPU, and why: ``unroll=`` and blocked scans that emit several rows per step
(XLA fuses the unrolled chain into every output row, so the work grows quadratically with
the block; PureJaxRL's ``unroll=16``); two-level chunked scans (extra passes over memory,
and strided row updates defeat XLA's in-place buffers); ``"associative"`` (``log T`` passes
over memory). A matrix form for short ``T`` was not pursued: dones make the matrix
batch-dependent.

References:
  Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation", 2016. Shao et al., "DeepSeekMath" (GRPO), 2024.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "METHODS",
    "chunk_rewards",
    "discounted_returns",
    "flatten_action_level",
    "gae",
    "gae_from_next_values",
    "group_advantages",
    "normalize_advantages",
    "resolve_method",
    "unflatten_action_level",
]

Method = Literal["auto", "inplace", "scan", "associative"]
METHODS: tuple[str, ...] = ("inplace", "scan", "associative")
# Below this many trajectories per time row, auto prefers "scan" on CPU (see module docs).
_CPU_SCAN_BELOW_WIDTH = 8


# ----------------------------------------------------------------------------- checks


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(jnp.shape(x))


def _float_dtype(*arrays: Any) -> jnp.dtype:
    """Compute dtype: at least float32, float64 when an input is float64 (each input's
    dtype is read on its own: no implicit promotion between them)."""
    wide = any(jnp.result_type(a) == jnp.float64 for a in arrays)
    return jnp.dtype(jnp.float64) if wide else jnp.dtype(jnp.float32)


def _check_bool(fn: str, name: str, x: Any) -> None:
    if jnp.result_type(x) != jnp.bool_:
        raise ValueError(f"{fn}: `{name}` must be boolean, got dtype {jnp.result_type(x)}")


def _check_numeric(fn: str, name: str, x: Any) -> None:
    dt = jnp.result_type(x)
    if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
        raise ValueError(f"{fn}: `{name}` must be a real number array, got dtype {dt}")


def _check_rate(fn: str, name: str, x: Any) -> None:
    """A discount or trace parameter: a scalar, in [0, 1] when known at trace time."""
    if isinstance(x, (bool, int, float)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"{fn}: `{name}` must lie in [0, 1], got {x}")
    elif _shape(x) != ():
        raise ValueError(f"{fn}: `{name}` must be a scalar, got shape {_shape(x)}")


def _check_time_major(fn: str, rewards: Any, **others: tuple[Any, int]) -> int:
    """Check ``rewards [T, ...]`` and each ``name=(array, extra)`` as ``[T+extra, ...]``."""
    rs = _shape(rewards)
    if len(rs) < 1:
        raise ValueError(f"{fn}: `rewards` must be time-major [T, ...], got a scalar")
    T, batch = rs[0], rs[1:]
    for name, (x, extra) in others.items():
        xs = _shape(x)
        want = (T + extra,) + batch
        if xs != want:
            span = "T+1" if extra else "T"
            raise ValueError(
                f"{fn}: `{name}` must have shape [{span}, ...] = {want} to match `rewards` "
                f"{rs}, got {xs}"
            )
    return T


def resolve_method(
    method: str, num_steps: int, width: int, *, backend: str | None = None
) -> str:
    """The formulation ``method`` stands for, a pure function of static sizes and backend.

    ::

        auto -> "scan"         on CPU with width < 8
                "inplace"      on CPU with width >= 8
                "associative"  on any other backend

    Args:
      method: ``"auto"`` or one of ``METHODS``.
      num_steps: ``T``, the length of the recurrence (the rule does not depend on it now).
      width: the number of independent trajectories (the product of the batch shape).
      backend: ``"cpu"``, ``"gpu"``, ``"tpu"``...; default ``jax.default_backend()``.

    Returns:
      A member of ``METHODS``. Resolution is static: it happens at trace time.

    Example::

        resolve_method("auto", 64, 256, backend="cpu")  # "inplace"
    """
    del num_steps
    if method == "auto":
        if (backend or jax.default_backend()) == "cpu":
            return "scan" if width < _CPU_SCAN_BELOW_WIDTH else "inplace"
        return "associative"
    if method not in METHODS:
        raise ValueError(f"`method` must be 'auto' or one of {METHODS}, got {method!r}")
    return method


# ----------------------------------------------------------------------------- core


def _row(x: jax.Array, t: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(x, t, 0, keepdims=False, allow_negative_indices=False)


def _sweep_inplace(x_t, cut, offset, discount):
    """Reverse sweep updating ``x_t`` in place; see ``_discounted_cumsum``."""
    T = x_t.shape[0]

    def body(i, y):
        t = T - 2 - i
        y_tp1 = _row(y, t + 1)
        y_t = _row(y, t) + jnp.where(_row(cut, t + offset), 0.0, discount * y_tp1)
        return lax.dynamic_update_index_in_dim(y, y_t, t, 0, allow_negative_indices=False)

    return lax.fori_loop(0, T - 1, body, x_t)


def _sweep_scan(x_t, cut_t, discount):
    def step(y_tp1, xs):
        x, cut = xs
        y = x + jnp.where(cut, 0.0, discount * y_tp1)
        return y, y

    _, y = lax.scan(step, jnp.zeros_like(x_t[0]), (x_t, cut_t), reverse=True)
    return y


def _sweep_associative(x_t, cut_t, discount):
    c_t = jnp.where(cut_t, jnp.zeros((), x_t.dtype), discount)

    def compose(later, earlier):
        # ``later`` maps y_{s+1} -> y_u for a block u..s nearer the end; ``earlier`` maps
        # y_u -> y_t. Their composition maps y_{s+1} -> y_t. The select keeps a cut exact
        # (and keeps NaN after a done from flowing back).
        c_l, b_l = later
        c_e, b_e = earlier
        return c_e * c_l, jnp.where(c_e == 0, b_e, b_e + c_e * b_l)

    _, y = lax.associative_scan(compose, (c_t, x_t), reverse=True)
    return y


def _discounted_cumsum(x_t, cut, offset, discount, method):
    """``y_t = x_t + [not cut_{t+offset}] * discount * y_{t+1}``, ``y_T = 0``.

    ``x_t`` is ``[T, N]`` floating, ``cut`` is ``[T+offset, N]`` boolean; reading ``cut`` at
    an offset lets the in-place sweep index ``dones[t+1]`` without copying ``dones[1:]``.
    """
    T = x_t.shape[0]
    if T == 0:
        return x_t
    discount = jnp.asarray(discount, x_t.dtype)
    if method == "inplace":
        return _sweep_inplace(x_t, cut, offset, discount)
    cut_t = cut[offset : offset + T]
    if method == "scan":
        return _sweep_scan(x_t, cut_t, discount)
    return _sweep_associative(x_t, cut_t, discount)


def _flat(x: jax.Array, rows: int) -> jax.Array:
    """``[rows, ...] -> [rows, N]`` (a free reshape)."""
    return x.reshape((rows, math.prod(x.shape[1:])))


# ----------------------------------------------------------------------------- GAE


def gae(
    rewards: jax.Array,
    values: jax.Array,
    dones: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    method: Method = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimates and returns, time-major (RLinf's recurrence).

    ::

        delta_t = r_t + gamma * v_{t+1} * (1 - d_{t+1}) - v_t
        A_t     = delta_t + gamma * lam * (1 - d_{t+1}) * A_{t+1},   A_T = 0
        R_t     = A_t + v_t

    A done ends both the bootstrap and the trace. For a time-limit truncation, add
    ``gamma * V(final obs)`` to that step's reward (as ``EnvTransition.chunk_rewards``
    does) and mark it done; ``gae_from_next_values`` is the terminated/truncated form.

    Args:
      rewards: ``r_t``, ``[T, ...]``, t = 0..T-1.
      values: ``v_t``, ``[T+1, ...]``, t = 0..T; ``values[T]`` is the bootstrap value.
      dones: ``d_t``, bool ``[T+1, ...]``, t = 0..T; ``dones[0]`` belongs to the state before
        the first action and is not read, ``dones[t+1]`` ends the episode after action t.
      gamma: discount, a scalar in [0, 1].
      lam: GAE lambda, a scalar in [0, 1].
      method: ``"auto"`` (by backend and width, see ``resolve_method``), ``"inplace"``,
        ``"scan"`` or ``"associative"``; static.

    Returns:
      ``(advantages, returns)``, each ``[T, ...]``, in the inputs' floating dtype (at least
      float32).

    Example::

        r = jnp.array([[1.0], [0.0], [2.0]])                  # T=3, B=1
        v = jnp.array([[0.5], [0.5], [0.5], [1.0]])
        d = jnp.array([[False], [False], [True], [False]])    # episode ends after step 1
        adv, ret = jaxtraj.advantages.gae(r, v, d, gamma=0.9, lam=1.0)
        # ret[:, 0] == [1.0, 0.0, 2.9]: step 1 does not bootstrap, step 2 starts afresh
    """
    fn = "gae"
    T = _check_time_major(fn, rewards, values=(values, 1), dones=(dones, 1))
    _check_numeric(fn, "rewards", rewards)
    _check_numeric(fn, "values", values)
    _check_bool(fn, "dones", dones)
    _check_rate(fn, "gamma", gamma)
    _check_rate(fn, "lam", lam)
    shape = _shape(rewards)
    dtype = _float_dtype(rewards, values)
    r_t = _flat(jnp.asarray(rewards, dtype), T)
    v = _flat(jnp.asarray(values, dtype), T + 1)
    d = _flat(jnp.asarray(dones), T + 1)
    method = resolve_method(method, T, r_t.shape[1])

    v_t, v_tp1, d_tp1 = v[:-1], v[1:], d[1:]
    delta_t = r_t + gamma * jnp.where(d_tp1, jnp.zeros((), dtype), v_tp1) - v_t
    adv_t = _discounted_cumsum(delta_t, d, 1, gamma * lam, method)
    return adv_t.reshape(shape), (adv_t + v_t).reshape(shape)


def gae_from_next_values(
    rewards: jax.Array,
    values: jax.Array,
    next_values: jax.Array,
    terminated: jax.Array,
    done: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    method: Method = "auto",
) -> tuple[jax.Array, jax.Array]:
    """GAE in the terminated/truncated form of TorchRL and Brax.

    ::

        delta_t = r_t + gamma * (1 - terminated_t) * v'_t - v_t
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   A_T = 0
        R_t     = A_t + v_t

    A truncated step (``done`` but not ``terminated``) bootstraps from ``v'_t``, the value
    of its final observation; any done cuts the trace. With ``terminated == done`` and
    ``next_values[t] == values[t+1]`` this is exactly ``gae``.

    Args:
      rewards: ``r_t``, ``[T, ...]``.
      values: ``v_t``, the value of the state action t was taken in, ``[T, ...]``.
      next_values: ``v'_t``, the value of the observation after action t (the final
        observation when the episode ended there), ``[T, ...]``.
      terminated: bool ``[T, ...]``; the episode reached a terminal state after action t.
      done: bool ``[T, ...]``; the episode ended after action t (terminated or truncated).
      gamma: discount, a scalar in [0, 1].
      lam: GAE lambda, a scalar in [0, 1].
      method: as for ``gae``.

    Returns:
      ``(advantages, returns)``, each ``[T, ...]``.

    Example::

        # one step, truncated: bootstraps from V(final obs) = 2.0
        adv, ret = gae_from_next_values(
            jnp.array([1.0]), jnp.array([0.0]), jnp.array([2.0]),
            jnp.array([False]), jnp.array([True]), gamma=0.5, lam=0.9)
        # ret == [2.0]
    """
    fn = "gae_from_next_values"
    T = _check_time_major(
        fn,
        rewards,
        values=(values, 0),
        next_values=(next_values, 0),
        terminated=(terminated, 0),
        done=(done, 0),
    )
    for name, x in (("rewards", rewards), ("values", values), ("next_values", next_values)):
        _check_numeric(fn, name, x)
    _check_bool(fn, "terminated", terminated)
    _check_bool(fn, "done", done)
    _check_rate(fn, "gamma", gamma)
    _check_rate(fn, "lam", lam)
    shape = _shape(rewards)
    dtype = _float_dtype(rewards, values, next_values)
    r_t = _flat(jnp.asarray(rewards, dtype), T)
    v_t = _flat(jnp.asarray(values, dtype), T)
    nv_t = _flat(jnp.asarray(next_values, dtype), T)
    term_t = _flat(jnp.asarray(terminated), T)
    done_t = _flat(jnp.asarray(done), T)
    method = resolve_method(method, T, r_t.shape[1])

    delta_t = r_t + gamma * jnp.where(term_t, jnp.zeros((), dtype), nv_t) - v_t
    adv_t = _discounted_cumsum(delta_t, done_t, 0, gamma * lam, method)
    return adv_t.reshape(shape), (adv_t + v_t).reshape(shape)


def discounted_returns(
    rewards: jax.Array,
    dones: jax.Array,
    *,
    gamma: float | jax.Array,
    method: Method = "auto",
) -> jax.Array:
    """Critic-free returns: discounted reward sums, cut at dones.

    ::

        G_t = r_t + gamma * (1 - d_{t+1}) * G_{t+1},   G_T = 0

    There is no bootstrap: a trajectory still running at ``T`` sums what it has. GRPO-style
    episode scores are ``G`` at each episode's first step (see ``group_advantages``).

    Args:
      rewards: ``r_t``, ``[T, ...]``.
      dones: bool ``[T+1, ...]`` with the layout of ``gae``: ``dones[t+1]`` ends the episode
        after action t; ``dones[0]`` is not read.
      gamma: discount, a scalar in [0, 1].
      method: as for ``gae``.

    Returns:
      ``G_t``, ``[T, ...]``.

    Example::

        r = jnp.array([1.0, 1.0, 1.0])
        d = jnp.array([False, False, True, False])
        discounted_returns(r, d, gamma=0.5)  # [1.5, 1.0, 1.0]
    """
    fn = "discounted_returns"
    T = _check_time_major(fn, rewards, dones=(dones, 1))
    _check_numeric(fn, "rewards", rewards)
    _check_bool(fn, "dones", dones)
    _check_rate(fn, "gamma", gamma)
    shape = _shape(rewards)
    r_t = _flat(jnp.asarray(rewards, _float_dtype(rewards)), T)
    d = _flat(jnp.asarray(dones), T + 1)
    method = resolve_method(method, T, r_t.shape[1])
    return _discounted_cumsum(r_t, d, 1, gamma, method).reshape(shape)


# ----------------------------------------------------------------------------- action level


def chunk_rewards(rewards_tk: jax.Array, mode: Literal["sum", "flatten"]) -> jax.Array:
    """Action-level rewards ``[T, ..., K]`` as chunk-level or per-action steps.

    Args:
      rewards_tk: ``[T, ..., K]``, ``rewards_tk[t, ..., k]`` is the reward of action k of
        chunk t.
      mode: ``"sum"`` returns ``[T, ...]``, the chunk's total (undiscounted within the chunk,
        as RLinf's chunk-level reward). ``"flatten"`` returns ``[T*K, ...]`` in execution
        order, step ``t*K + k``; use ``flatten_action_level`` to get matching values and
        dones.

    Returns:
      ``[T, ...]`` or ``[T*K, ...]``.

    Example::

        chunk_rewards(jnp.ones((3, 4, 2)), "flatten").shape  # (6, 4)
    """
    shape = _shape(rewards_tk)
    if len(shape) < 2:
        raise ValueError(f"chunk_rewards: `rewards_tk` must be [T, ..., K], got shape {shape}")
    _check_numeric("chunk_rewards", "rewards_tk", rewards_tk)
    if mode == "sum":
        return jnp.sum(rewards_tk, axis=-1)
    if mode == "flatten":
        moved = jnp.moveaxis(rewards_tk, -1, 1)  # [T, K, ...]
        return moved.reshape((shape[0] * shape[-1],) + shape[1:-1])
    raise ValueError(f"chunk_rewards: `mode` must be 'sum' or 'flatten', got {mode!r}")


def flatten_action_level(
    rewards: jax.Array, values: jax.Array, dones: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Expand chunk data to one time step per action, ready for ``gae``.

    With ``K`` actions per chunk, step ``s = t*K + k`` is action k of chunk t:

    * ``r[s] = rewards[t, ..., k]``;
    * ``v[s] = values[t]`` for every k: the critic scores the state a chunk starts from, so
      its value is repeated over the chunk's actions; ``v[T*K] = values[T]`` bootstraps;
    * per-action ``dones [T+1, ..., K]``: ``d[s+1] = dones[t+1, ..., k]``, the episode ended
      with action k; ``d[0] = dones[0, ..., K-1]``;
    * chunk-level ``dones [T+1, ...]``: the done falls on the chunk's last action,
      ``d[t*K + K] = dones[t+1]``, the other steps are not done; ``d[0] = dones[0]``.

    Args:
      rewards: ``[T, ..., K]``.
      values: ``[T+1, ...]``.
      dones: bool, ``[T+1, ..., K]`` (per action) or ``[T+1, ...]`` (per chunk).

    Returns:
      ``(r [T*K, ...], v [T*K+1, ...], d [T*K+1, ...])``. ``gae`` on these gives per-action
      advantages; ``unflatten_action_level`` restores ``[T, ..., K]``.

    Example::

        r, v, d = flatten_action_level(rewards_tbk, values_tb, dones_tbk)
        adv, ret = gae(r, v, d, gamma=0.99, lam=0.95)
        adv_tbk = unflatten_action_level(adv, rewards_tbk.shape[-1])
    """
    fn = "flatten_action_level"
    rs, vs, ds = _shape(rewards), _shape(values), _shape(dones)
    if len(rs) < 2:
        raise ValueError(f"{fn}: `rewards` must be [T, ..., K], got shape {rs}")
    T, K, batch = rs[0], rs[-1], rs[1:-1]
    if vs != (T + 1,) + batch:
        raise ValueError(
            f"{fn}: `values` must have shape [T+1, ...] = {(T + 1,) + batch} for `rewards` "
            f"{rs}, got {vs}"
        )
    if ds not in ((T + 1,) + batch + (K,), (T + 1,) + batch):
        raise ValueError(
            f"{fn}: `dones` must have shape {(T + 1,) + batch + (K,)} (per action) or "
            f"{(T + 1,) + batch} (per chunk) for `rewards` {rs}, got {ds}"
        )
    _check_numeric(fn, "rewards", rewards)
    _check_numeric(fn, "values", values)
    _check_bool(fn, "dones", dones)
    r = chunk_rewards(rewards, "flatten")
    v = jnp.concatenate([jnp.repeat(values[:-1], K, axis=0), values[-1:]], axis=0)
    if ds == (T + 1,) + batch + (K,):
        d0, d_after = dones[:1, ..., K - 1], dones[1:]
    else:  # per chunk: the done lands on the last action
        d0 = dones[:1]
        last = jnp.arange(K) == K - 1
        d_after = jnp.logical_and(dones[1:, ..., None], last.reshape((1,) * len(ds) + (K,)))
    d_after = jnp.moveaxis(d_after, -1, 1).reshape((T * K,) + batch)
    return r, v, jnp.concatenate([d0, d_after], axis=0)


def unflatten_action_level(x: jax.Array, actions_per_chunk: int) -> jax.Array:
    """Inverse of the flattening: ``[T*K, ...] -> [T, ..., K]``."""
    shape, K = _shape(x), actions_per_chunk
    if len(shape) < 1 or K < 1 or shape[0] % K:
        raise ValueError(
            f"unflatten_action_level: `x` must be [T*K, ...] with K = {K} actions per chunk, "
            f"got shape {shape}"
        )
    return jnp.moveaxis(x.reshape((shape[0] // K, K) + shape[1:]), 1, -1)


# ----------------------------------------------------------------------------- normalisation


def normalize_advantages(
    adv: jax.Array,
    mask: jax.Array,
    *,
    eps: float = 1e-8,
    axis_name: str | Sequence[str] | None = None,
) -> jax.Array:
    """Masked advantage normalisation, optionally global across devices.

    ::

        mean = sum(mask * adv) / n,   std = sqrt(sum(mask * (adv - mean)^2) / n)
        out  = mask * (adv - mean) / (std + eps)

    with ``n = sum(mask)``, so padding and post-done rows affect neither statistic and come
    out as 0. With ``axis_name``, the sums are ``lax.psum``-reduced over that named axis
    (inside ``shard_map``, ``pmap`` or a named ``vmap``), so every shard is normalised with
    the same global statistics. The variance is computed around the mean (two reductions),
    not as ``E[x^2] - E[x]^2``.

    Args:
      adv: advantages, any shape.
      mask: bool (or 0/1) array broadcastable to ``adv.shape``; True marks valid entries.
      eps: added to the standard deviation.
      axis_name: a named axis (or axes) to reduce the statistics over, or None.

    Returns:
      Normalised advantages, ``adv.shape``; masked entries are 0. If no entry is valid the
      result is all zeros.

    Example::

        normalize_advantages(jnp.array([1.0, 3.0, 100.0]), jnp.array([True, True, False]))
        # [-1.0, 1.0, 0.0]
    """
    fn = "normalize_advantages"
    _check_numeric(fn, "adv", adv)
    shape = _shape(adv)
    try:
        ok = tuple(jnp.broadcast_shapes(_shape(mask), shape)) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{fn}: `mask` of shape {_shape(mask)} does not broadcast to `adv` shape {shape}"
        )
    dtype = _float_dtype(adv)
    x = jnp.asarray(adv, dtype)
    m = jnp.broadcast_to(jnp.asarray(mask).astype(bool), shape)
    zero = jnp.zeros((), dtype)

    def total(v):
        s = jnp.sum(v)
        return s if axis_name is None else lax.psum(s, axis_name)

    n = jnp.maximum(total(m.astype(dtype)), 1.0)
    mean = total(jnp.where(m, x, zero)) / n
    centred = jnp.where(m, x - mean, zero)
    std = jnp.sqrt(total(centred * centred) / n)
    return centred / (std + eps)


def group_advantages(
    scores: jax.Array, group_size: int, *, eps: float = 1e-6, ddof: int = 1
) -> jax.Array:
    """GRPO group-relative advantages: each score against its group.

    ::

        A_i = (s_i - mean_g) / (std_g + eps)   for i in group g = i // group_size

    Groups are ``group_size`` consecutive entries along the leading axis (the episodes
    rolled out from one prompt or initial state).

    Args:
      scores: ``[N, ...]``, e.g. per-episode returns (``discounted_returns`` at each
        episode's first step).
      group_size: entries per group; must divide ``N`` and exceed ``ddof``; static.
      eps: added to the standard deviation.
      ddof: delta degrees of freedom of the standard deviation. The default 1 is the
        unbiased estimate that ``torch.std`` (RLinf, TRL) uses; 0 gives the population std.

    Returns:
      ``[N, ...]`` advantages, float.

    Example::

        group_advantages(jnp.array([1.0, 3.0, 0.0, 0.0]), 2)  # [-0.707, 0.707, 0.0, 0.0]
    """
    fn = "group_advantages"
    shape = _shape(scores)
    _check_numeric(fn, "scores", scores)
    try:
        size = operator.index(group_size)
    except TypeError:
        size = 0
    if isinstance(group_size, bool) or size < 1:
        raise ValueError(f"{fn}: `group_size` must be a positive int, got {group_size!r}")
    group_size = size
    if len(shape) < 1 or shape[0] % group_size:
        raise ValueError(
            f"{fn}: `group_size` {group_size} must divide the leading axis of `scores` {shape}"
        )
    if group_size <= ddof:
        raise ValueError(f"{fn}: `group_size` {group_size} must exceed `ddof` {ddof}")
    x = jnp.asarray(scores, _float_dtype(scores))
    g = x.reshape((shape[0] // group_size, group_size) + shape[1:])
    mean = jnp.mean(g, axis=1, keepdims=True)
    std = jnp.std(g, axis=1, keepdims=True, ddof=ddof)
    return ((g - mean) / (std + eps)).reshape(shape)
