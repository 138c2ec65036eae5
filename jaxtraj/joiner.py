"""Join the two halves of every chunk by key, in fixed-capacity device buffers.

Pure functions in the manner of optax and flashbax: :func:`init` allocates every
buffer once from the plan and one example of each half; :func:`add_policy` and
:func:`add_env` write one half (or a fragment of it) into its slot and return the new
state; :func:`add_policies` / :func:`add_envs` write a stack of parts in one call.

A state holds one source: buffers ``[E, T, B, ...]`` (epochs, chunks, rows) and a
per-row coverage mask for each half, so a slot is complete when both halves cover
all ``B`` rows, whatever the arrival order or fragmentation. Several sources are a
*stacked* state, every leaf with a leading source axis ``[S, ...]``: what
``jax.vmap`` over single-source states gives, and what :func:`init` returns for a
plan with several sources. The functions accept both: on a stacked state they route
each part to its source's slice by ``(env_rank, stage_id)``.

Jit them with the state donated and an insert writes only the part's rows, in place::

    add = jax.jit(jaxtraj.add_policy, static_argnums=0, donate_argnums=1)
    state = add(plan, state, part)

A rejected part leaves the state's data unchanged and records an error code (see
:mod:`jaxtraj.errors`); the state stays usable and flushes what it had.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxtraj import slots
from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import EnvPart, EnvTransition, PolicyPart, rlt_features

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
      epochs_flushed: ``[E]`` bool, epochs pipeline mode has flushed this step.
      sources: ``[2]`` int32, the ``(env_rank, stage_id)`` this state holds.
      step: int32, the source's current training step.
      error_code, error_key, error_count: the first rejection under ``jit``, its key
        ``[5]``, and how many parts were rejected.
    """

    policy: PyTree
    env: PyTree
    initial: EnvTransition
    policy_rows: jax.Array
    env_rows: jax.Array
    next_obs_given: jax.Array | None
    next_rlt_given: jax.Array | None
    epochs_flushed: jax.Array
    sources: jax.Array
    step: jax.Array
    error_code: jax.Array
    error_key: jax.Array
    error_count: jax.Array

    @property
    def stacked(self) -> bool:
        """Whether every leaf has a leading source axis."""
        return self.sources.ndim == 2


def _alloc(example: PyTree, lead: tuple[int, ...]) -> PyTree:
    def zeros(x):
        dtype = jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))
        return jnp.zeros(lead + tuple(np.shape(x)[1:]), dtype)

    return jax.tree.map(zeros, example)


def _env_layout(plan: TrajectoryPlan, policy_example: PolicyPart, env_example: EnvPart) -> EnvPart:
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
    return EnvPart(
        source=None,
        transition=env_example.transition,
        next_obs=next_obs,
        initial_transition=None,
        final_values=final,
        next_rlt_obs=next_rlt,
    )


def _init_one(plan, policy_example, env_example, source, step_id) -> CollectorState:
    E, T, B = plan.num_epochs, plan.num_chunks, plan.batch_size
    return CollectorState(
        policy=_alloc(policy_example.replace(source=None), (E, T, B)),
        env=_alloc(_env_layout(plan, policy_example, env_example), (E, T, B)),
        initial=_alloc(env_example.transition.boundary(), (E, B)),
        policy_rows=jnp.zeros((E, T, B), bool),
        env_rows=jnp.zeros((E, T, B), bool),
        next_obs_given=jnp.zeros((E, T, B), bool) if plan.collect_transitions else None,
        next_rlt_given=jnp.zeros((E, T, B), bool) if plan.enable_rlt else None,
        epochs_flushed=jnp.zeros((E,), bool),
        sources=jnp.asarray(source, jnp.int32),
        step=jnp.asarray(step_id, jnp.int32),
        error_code=jnp.zeros((), jnp.int32),
        error_key=jnp.zeros((5,), jnp.int32),
        error_count=jnp.zeros((), jnp.int32),
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
      A :class:`CollectorState` with all buffers zeroed and nothing received.
    """
    if sources is None:
        sources = plan.default_sources()
        sources = sources[0] if len(sources) == 1 else sources
    sources = jnp.asarray(sources, jnp.int32)
    if sources.ndim == 1:
        return _init_one(plan, policy_example, env_example, sources, step_id)
    one = lambda src: _init_one(plan, policy_example, env_example, src, step_id)
    return jax.vmap(one)(sources)


def _lead(state: CollectorState) -> int:
    """Leading axes before the rows axis of the slot buffers (``[S,] E, T``)."""
    return state.policy_rows.ndim - 1


def policy_structure(state: CollectorState, part: PolicyPart, key: Any = None) -> int:
    """Check a policy half against the buffers (trace time); return its row count."""
    if not isinstance(part, PolicyPart):
        raise CollectorError(key, ErrorCode.STRUCTURE_MISMATCH, f"not a PolicyPart: {type(part)}")
    return slots.check_payload(
        "PolicyPart", part.replace(source=None), state.policy, _lead(state), key
    )


def env_structure(
    state: CollectorState, part: EnvPart, key: Any = None
) -> tuple[int, bool, bool, bool, bool]:
    """Check an env half against the buffers (trace time).

    Returns ``(rows, has_initial, has_final, has_next_obs, has_next_rlt)``: its row
    count and which optional boundary fields it carries that the buffers retain.
    """
    if not isinstance(part, EnvPart):
        raise CollectorError(key, ErrorCode.STRUCTURE_MISMATCH, f"not an EnvPart: {type(part)}")
    lead, layout = _lead(state), state.env
    optional = dict(initial_transition=None, final_values=None, next_obs=None, next_rlt_obs=None)
    payload = part.replace(source=None, **optional)
    rows = slots.check_payload("EnvPart", payload, layout.replace(**optional), lead, key)
    _check_interventions(state, part.transition, lead, key)
    has_final = part.final_values is not None
    if has_final:
        if layout.final_values is None:
            raise CollectorError(
                key,
                ErrorCode.STRUCTURE_MISMATCH,
                "EnvPart.final_values given, but the plan's examples carry no values",
            )
        slots.check_payload(
            "EnvPart.final_values", part.final_values, layout.final_values, lead, key
        )
    # A next_obs override is part of the contract; it is only retained with collect_transitions.
    has_next = part.next_obs is not None and layout.next_obs is not None
    if has_next:
        slots.check_payload("EnvPart.next_obs", part.next_obs, layout.next_obs, lead, key)
    has_rlt = part.next_rlt_obs is not None and layout.next_rlt_obs is not None
    if has_rlt:
        slots.check_payload(
            "EnvPart.next_rlt_obs", part.next_rlt_obs, layout.next_rlt_obs, lead, key
        )
    has_initial = part.initial_transition is not None
    if has_initial:
        slots.check_payload(
            "EnvPart.initial_transition",
            part.initial_transition.boundary(),
            state.initial,
            lead - 1,
            key,
        )
    return rows, has_initial, has_final, has_next, has_rlt


def _check_interventions(state: CollectorState, tr: EnvTransition, lead: int, key: Any) -> None:
    """Interventions must fit the action chunk: ``intervene_actions`` as many elements per
    row as the policy's actions, ``intervene_flags`` boolean, one per action ``[rows, K]``."""
    actions = state.policy.output.actions
    per_row = int(np.prod(actions.shape[lead + 1 :]))
    if tr.intervene_actions is not None:
        shape = np.shape(tr.intervene_actions)
        if int(np.prod(shape[1:])) != per_row:
            raise CollectorError(
                key,
                ErrorCode.STRUCTURE_MISMATCH,
                f"EnvTransition.intervene_actions: shape {tuple(shape)} does not match the "
                f"action chunk {tuple(actions.shape[lead + 1 :])} per row",
            )
        if tr.intervene_flags is None:
            raise CollectorError(
                key, ErrorCode.STRUCTURE_MISMATCH, "intervene_actions without intervene_flags"
            )
    if tr.intervene_flags is not None:
        shape = np.shape(tr.intervene_flags)
        dtype = getattr(tr.intervene_flags, "dtype", None)
        if dtype != np.bool_ or len(shape) != 2 or per_row % max(shape[1], 1):
            raise CollectorError(
                key,
                ErrorCode.STRUCTURE_MISMATCH,
                f"EnvTransition.intervene_flags: must be bool [rows, K] with K dividing the "
                f"{per_row} action elements per row, got {dtype} {tuple(shape)}",
            )


def _write(buffer: PyTree, data: PyTree, start: tuple, ok: jax.Array) -> PyTree:
    """Write ``data`` (leaves ``[rows, ...]``) at ``start`` where ``ok``; cost ~ the part.

    ``start`` indexes the leading axes, ending with the row offset. Where not ok the
    old rows are written back, so a rejected part changes nothing.
    """

    def one(buf, x):
        x = jnp.asarray(x, buf.dtype)
        x = x.reshape((1,) * (len(start) - 1) + x.shape)
        idx = tuple(start) + (0,) * (x.ndim - len(start))
        old = lax.dynamic_slice(buf, idx, x.shape)
        return lax.dynamic_update_slice(buf, jnp.where(ok, x, old), idx)

    return jax.tree.map(one, buffer, data)


def _key_vector(key) -> jax.Array:
    return jnp.stack([jnp.asarray(k, jnp.int32) for k in key.fields()])


def record_error(state: CollectorState, code: jax.Array, key, s: Any = None) -> CollectorState:
    """Record ``code`` (if non-zero) for ``key``: the first error wins; all are counted.

    ``s`` is the source index of a stacked state.
    """
    at = (lambda x: x[s]) if s is not None else (lambda x: x)
    put = (lambda x, v: x.at[s].set(v)) if s is not None else (lambda x, v: v)
    first = (at(state.error_code) == 0) & (code != 0)
    return state.replace(
        error_code=put(state.error_code, jnp.where(first, code, at(state.error_code))),
        error_key=put(state.error_key, jnp.where(first, _key_vector(key), at(state.error_key))),
        error_count=put(state.error_count, at(state.error_count) + (code != 0).astype(jnp.int32)),
    )


def _any(x: Any) -> jax.Array:
    return jnp.asarray(False) if x is None else jnp.any(x)


def _nonfinite(plan: TrajectoryPlan, part: Any) -> jax.Array:
    if plan.nonfinite != "reject":
        return jnp.asarray(False)
    bad = [~jnp.all(jnp.isfinite(x)) for x in slots.finite_leaves(part)]
    return jnp.any(jnp.stack(bad)) if bad else jnp.asarray(False)


def _route(plan, state, part, rows, rows_mask):
    """Key checks, the duplicate check, and where the part's rows start.

    Returns ``(checks, start, s, key)``: ``start`` indexes the slot buffers
    (``(s, e, t, offset)`` on a stacked state, ``(e, t, offset)`` otherwise).
    """
    as32 = lambda v: jnp.asarray(v, jnp.int32)
    src = part.source
    src = src.replace(
        key=jax.tree.map(as32, src.key), batch_size=as32(src.batch_size), offset=as32(src.offset)
    )
    key = src.key
    if state.stacked:
        found, s = slots.locate(jnp, state.sources, key.env_rank, key.stage_id)
        prefix, step = (s,), state.step[s]
    else:
        found = (state.sources[0] == key.env_rank) & (state.sources[1] == key.stage_id)
        s, prefix, step = None, (), state.step
    checks = slots.key_checks(jnp, plan, src, rows, found, step)
    start = prefix + (key.epoch_id, key.chunk_id, src.offset)
    dup = jnp.any(lax.dynamic_slice(rows_mask, start, (1,) * (len(start) - 1) + (rows,)))
    checks.append((dup, ErrorCode.DUPLICATE))
    return checks, start, s, key


def add_policy(plan: TrajectoryPlan, state: CollectorState, part: PolicyPart) -> CollectorState:
    """Write a policy half (or fragment) into its slot.

    Args:
      plan: the static plan (``jit`` static argument).
      state: the collector state (donate it).
      part: a :class:`PolicyPart`; its payload leaves are ``[rows, ...]``.

    Returns:
      The new state. A rejected part changes nothing but the error record.
    """
    rows = policy_structure(state, part)
    checks, start, s, key = _route(plan, state, part, rows, state.policy_rows)
    checks.append((_nonfinite(plan, part), ErrorCode.NON_FINITE))
    code = slots.first_error(jnp, checks)
    ok = code == 0
    state = state.replace(
        policy=_write(state.policy, part.replace(source=None), start, ok),
        policy_rows=_write(state.policy_rows, jnp.ones((rows,), bool), start, ok),
    )
    return record_error(state, code, key, s)


def add_env(plan: TrajectoryPlan, state: CollectorState, part: EnvPart) -> CollectorState:
    """Write an env half (or fragment) into its slot.

    Chunk zero must carry ``initial_transition``; the last chunk must carry
    ``final_values`` when policy halves carry values, and ``next_obs`` with
    ``collect_transitions``. ``next_obs`` elsewhere is an optional override.
    """
    layout = state.env
    rows, has_initial, has_final, has_next, has_rlt = env_structure(state, part)
    checks, start, s, key = _route(plan, state, part, rows, state.env_rows)
    checks += slots.env_checks(
        jnp,
        plan,
        key.chunk_id,
        has_initial=has_initial,
        has_final=has_final,
        has_next_obs=has_next or layout.next_obs is None,
        has_next_rlt=has_rlt or layout.next_rlt_obs is None,
        needs_final=state.policy.output.prev_values is not None,
        cut=_any(slots.cut_flags(plan, part)),
    )
    checks.append((_nonfinite(plan, part), ErrorCode.NON_FINITE))
    code = slots.first_error(jnp, checks)
    ok = code == 0
    lead = len(start) - 1

    def fill(buf_leaf):  # absent optional fields are written as zeros: no stale data
        return jnp.zeros((rows,) + buf_leaf.shape[lead + 1 :], buf_leaf.dtype)

    written = part.replace(
        source=None,
        initial_transition=None,
        final_values=part.final_values if has_final else jax.tree.map(fill, layout.final_values),
        next_obs=part.next_obs if has_next else jax.tree.map(fill, layout.next_obs),
        next_rlt_obs=part.next_rlt_obs if has_rlt else jax.tree.map(fill, layout.next_rlt_obs),
    )
    state = state.replace(
        env=_write(layout, written, start, ok),
        env_rows=_write(state.env_rows, jnp.ones((rows,), bool), start, ok),
    )
    if state.next_obs_given is not None:
        given = jnp.full((rows,), has_next, bool)
        state = state.replace(next_obs_given=_write(state.next_obs_given, given, start, ok))
    if state.next_rlt_given is not None:
        given = jnp.full((rows,), has_rlt, bool)
        state = state.replace(next_rlt_given=_write(state.next_rlt_given, given, start, ok))
    if has_initial:
        initial_start = start[:-3] + (key.epoch_id, start[-1])
        state = state.replace(
            initial=_write(state.initial, part.initial_transition.boundary(), initial_start, ok)
        )
    return record_error(state, code, key, s)


def add_policies(plan: TrajectoryPlan, state: CollectorState, parts: PolicyPart) -> CollectorState:
    """Write a stack of policy halves (leading axis ``N`` on every leaf) in one call.

    Equivalent to ``N`` calls of :func:`add_policy` in order, in one dispatch.
    """
    return lax.scan(lambda st, p: (add_policy(plan, st, p), None), state, parts)[0]


def add_envs(plan: TrajectoryPlan, state: CollectorState, parts: EnvPart) -> CollectorState:
    """Write a stack of env halves (leading axis ``N``) in one call; see :func:`add_policies`."""
    return lax.scan(lambda st, p: (add_env(plan, st, p), None), state, parts)[0]


def slot_complete(state: CollectorState) -> jax.Array:
    """``[E, T]`` (``[S, E, T]`` stacked) bool: both halves cover every row of the slot."""
    return jnp.all(state.policy_rows & state.env_rows, axis=-1)


def source_complete(state: CollectorState) -> jax.Array:
    """bool (``[S]`` stacked): every slot of the source's current training step is complete."""
    return jnp.all(slot_complete(state), axis=(-2, -1))


@dataclasses.dataclass(frozen=True)
class ChunkJoiner:
    """The join's pure functions bound to a plan, for users who prefer an object.

    ``ChunkJoiner(plan).add_policy(state, part)`` is ``add_policy(plan, state, part)``.
    Hashable, so it can itself be a ``jit`` static argument::

        joiner = jaxtraj.ChunkJoiner(plan)
        state = joiner.init(policy_example, env_example)
        add = jax.jit(joiner.add_policy, donate_argnums=0)
    """

    plan: TrajectoryPlan

    def init(self, policy_example: PolicyPart, env_example: EnvPart, **kwargs) -> CollectorState:
        return init(self.plan, policy_example, env_example, **kwargs)

    def add_policy(self, state: CollectorState, part: PolicyPart) -> CollectorState:
        return add_policy(self.plan, state, part)

    def add_env(self, state: CollectorState, part: EnvPart) -> CollectorState:
        return add_env(self.plan, state, part)

    def add_policies(self, state: CollectorState, parts: PolicyPart) -> CollectorState:
        return add_policies(self.plan, state, parts)

    def add_envs(self, state: CollectorState, parts: EnvPart) -> CollectorState:
        return add_envs(self.plan, state, parts)

    slot_complete = staticmethod(slot_complete)
    source_complete = staticmethod(source_complete)
