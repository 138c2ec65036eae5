"""Join the two halves of every chunk by key: inserts into the state's buffers.

Pure functions in the manner of flashbax's ``add``: :func:`add_policy` and
:func:`add_env` write one half (or a fragment of it) into its slot and return the new
state; :func:`add_policies` / :func:`add_envs` write a stack of parts in one call. The
state comes from :func:`jaxtraj.state.init`. On a stacked state (a leading source
axis) each part is routed to its source's slice by ``(env_rank, stage_id)``.
:func:`add_env_uniform` takes env halves that carry ``initial_transition`` on every
chunk, so one ``lax.scan`` covers every chunk of an epoch, chunk zero included.

Jit them with the state donated and an insert writes only the part's rows, in place,
once: the checks read the key, the coverage masks and the few reward and value leaves;
the part's bytes and its coverage are written by one scatter each whose window a rejected
part sends out of bounds, where it is dropped: no branch around the data (a ``lax.cond``
made XLA copy a scanned part before writing it), nothing read back, and a rejected part
writes nothing of the buffers::

    add = jax.jit(jaxtraj.add_policy, static_argnums=0, donate_argnums=1)
    state = add(plan, state, part)

A rejected part leaves the state's data unchanged and records an error code (see
:mod:`jaxtraj.errors`); the state stays usable and flushes what it had.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtraj import checks
from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.state import CollectorState, record_error
from jaxtraj.types import EnvPart, PolicyPart

PyTree = Any


def _put(buffer: PyTree, data: PyTree, start: tuple, ok: Any) -> PyTree:
    """Write ``data`` (leaves ``[rows, ...]``) at ``start`` if ``ok``: one pass over the part.

    ``start`` indexes the leading axes, ending with the row offset; ``ok`` is a traced
    bool. Each leaf's write is one scatter of the part's window whose first index a false
    ``ok`` sends out of bounds, where XLA drops it (no branch, no copy of the operand,
    nothing read back; on the CPU it compiles to the same in-place update as a
    ``dynamic_update_slice``).
    """
    # Indices of one dtype, int32 like the key's (Python ints would be int64 under
    # jax_enable_x64, beside int32 key fields).
    at = tuple(i.astype(jnp.int32) if hasattr(i, "astype") else np.int32(i) for i in start)
    n = len(at)

    def one(buf, x):
        x = jnp.asarray(x, buf.dtype)
        window = x.reshape((1,) * (n - 1) + x.shape)
        first = jnp.where(ok, at[0], np.int32(buf.shape[0]))  # out of bounds: dropped
        index = jnp.stack((first,) + at[1:])[None]
        dims = lax.ScatterDimensionNumbers(
            update_window_dims=tuple(range(1, buf.ndim + 1)),
            inserted_window_dims=(),
            scatter_dims_to_operand_dims=tuple(range(n)),
        )
        return lax.scatter(
            buf, index, window[None], dims, indices_are_sorted=True, unique_indices=True,
            mode=lax.GatherScatterMode.FILL_OR_DROP,
        )

    return jax.tree.map(one, buffer, data)


def _nonfinite(plan: TrajectoryPlan, part: Any) -> jax.Array:
    if plan.nonfinite != "reject":
        return jnp.asarray(False)
    bad = [~jnp.all(jnp.isfinite(x)) for x in checks.finite_leaves(part)]
    return jnp.any(jnp.stack(bad)) if bad else jnp.asarray(False)


def _route(plan, state, part, rows, rows_mask):
    """Key checks, the duplicate check, and where the part's rows start.

    Returns ``(rules, start, s, key)``: ``start`` indexes the slot buffers
    (``(s, e, t, offset)`` on a stacked state, ``(e, t, offset)`` otherwise).
    """
    as32 = lambda v: jnp.asarray(v, jnp.int32)
    src = part.source
    src = src.replace(
        key=jax.tree.map(as32, src.key), batch_size=as32(src.batch_size), offset=as32(src.offset)
    )
    key = src.key
    if state.stacked:
        found, s = checks.locate(jnp, state.sources, key.env_rank, key.stage_id)
        s = as32(s)  # an argmax: int64 under jax_enable_x64; indices share one dtype
        prefix, step = (s,), state.step[s]
    else:
        found = (state.sources[0] == key.env_rank) & (state.sources[1] == key.stage_id)
        s, prefix, step = None, (), state.step
    rules = checks.key_checks(jnp, plan, src, rows, found, step)
    start = prefix + (key.epoch_id, key.chunk_id, src.offset)
    dup = jnp.any(lax.dynamic_slice(rows_mask, start, (1,) * (len(start) - 1) + (rows,)))
    rules.append((dup, ErrorCode.DUPLICATE))
    return rules, start, s, key


def _commit(state: CollectorState, code: jax.Array, key, s, write) -> CollectorState:
    """``write(state, ok)`` with ``ok = code == 0`` (its writes are dropped when not ok);
    record the code."""
    return record_error(write(state, code == 0), code, key, s)


def add_policy(plan: TrajectoryPlan, state: CollectorState, part: PolicyPart) -> CollectorState:
    """Write a policy half (or fragment) into its slot.

    Args:
      plan: the static plan (``jit`` static argument).
      state: the collector state (donate it).
      part: a :class:`PolicyPart`; its payload leaves are ``[rows, ...]``.

    Returns:
      The new state. A rejected part changes nothing but the error record.
    """
    if isinstance(part, PolicyPart):  # an expert's half: lerobot mode only (zero-filled)
        part = checks.expert_half(plan, state, part, jnp)
    rows = checks.policy_structure(state, part).rows
    rules, start, s, key = _route(plan, state, part, rows, state.policy_rows)
    rules.append((_nonfinite(plan, part), ErrorCode.NON_FINITE))
    code = checks.first_error(jnp, rules)

    def write(st, ok):
        return st.replace(
            policy=_put(st.policy, part.replace(source=None), start, ok),
            policy_rows=_put(st.policy_rows, jnp.ones((rows,), bool), start, ok),
        )

    return _commit(state, code, key, s, write)


def add_env(plan: TrajectoryPlan, state: CollectorState, part: EnvPart) -> CollectorState:
    """Write an env half (or fragment) into its slot.

    Chunk zero must carry ``initial_transition``; the last chunk must carry
    ``final_values`` when policy halves carry values, and ``next_obs`` with
    ``collect_transitions``. ``next_obs`` elsewhere is an optional override.
    A ``lax.scan`` over chunks uses :func:`add_env_uniform` instead.
    """
    return _add_env(plan, state, part, uniform=False)


def add_env_uniform(plan: TrajectoryPlan, state: CollectorState, part: EnvPart) -> CollectorState:
    """:func:`add_env` for env halves of one structure on every chunk, for a ``lax.scan``
    over every chunk of an epoch, chunk zero included.

    Every chunk's half carries ``initial_transition`` (and, if any chunk does,
    ``final_values``); only chunk zero's ``initial_transition`` is read, the others'
    are ignored (not rejected as ``UNEXPECTED_INITIAL_TRANSITION``). Everything else is
    checked as :func:`add_env` checks it::

        def chunk(state, t):
            policy, env = halves(t)  # env carries initial_transition for every t
            state = jaxtraj.add_policy(plan, state, policy)
            return jaxtraj.add_env_uniform(plan, state, env), None

        state, _ = lax.scan(chunk, state, jnp.arange(plan.num_chunks))

    Raises:
      CollectorError: ``STRUCTURE_MISMATCH`` (at trace time) for a half without
        ``initial_transition``.
    """
    return _add_env(plan, state, part, uniform=True)


def _add_env(plan: TrajectoryPlan, state: CollectorState, part: EnvPart, *, uniform: bool):
    layout = checks.env_structure(state, part)
    if uniform and not layout.has_initial:
        raise CollectorError(
            None,
            ErrorCode.STRUCTURE_MISMATCH,
            "add_env_uniform takes env halves that carry initial_transition on every chunk "
            "(only chunk zero's is read); use add_env for halves without it",
        )
    rows, lead = layout.rows, state.lead
    rules, start, s, key = _route(plan, state, part, rows, state.env_rows)
    rules += checks.env_checks(
        jnp,
        plan,
        key.chunk_id,
        layout._replace(
            has_next=layout.has_next or state.env.next_obs is None,
            has_rlt=layout.has_rlt or state.env.next_rlt_obs is None,
        ),
        needs_final=state.policy.output.prev_values is not None,
        cut=checks.cut_any(jnp, plan, part),
    )
    if uniform:  # every chunk carries initial_transition; only chunk zero's is read
        rules = [r for r in rules if r[1] != ErrorCode.UNEXPECTED_INITIAL_TRANSITION]
    rules.append((_nonfinite(plan, part), ErrorCode.NON_FINITE))
    if part.transition.valid_actions is not None:
        bad = checks.invalid_action_rows(jnp, part.transition, rows_ndim=1)
        rules.append((jnp.any(bad), ErrorCode.INVALID_ACTION_MASK))
    if part.transition.reward_assign_lengths is not None:
        bad = checks.negative_lengths(jnp, part.transition)
        rules.append((jnp.any(bad), ErrorCode.INVALID_REWARD_ASSIGN))
    code = checks.first_error(jnp, rules)

    def fill(buf_leaf):  # absent optional fields are written as zeros: no stale data
        return jnp.zeros((rows,) + buf_leaf.shape[lead + 1 :], buf_leaf.dtype)

    def optional(given, value, buffer):
        return value if given else jax.tree.map(fill, buffer)

    env = state.env
    written = part.replace(
        source=None,
        initial_transition=None,
        final_values=optional(layout.has_final, part.final_values, env.final_values),
        next_obs=optional(layout.has_next, part.next_obs, env.next_obs),
        next_rlt_obs=optional(layout.has_rlt, part.next_rlt_obs, env.next_rlt_obs),
        action_obs=part.action_obs if env.action_obs is not None else None,
    )

    def write(st, ok):
        out = dict(
            env=_put(st.env, written, start, ok),
            env_rows=_put(st.env_rows, jnp.ones((rows,), bool), start, ok),
        )
        if st.next_obs_given is not None:
            given = jnp.full((rows,), layout.has_next, bool)
            out["next_obs_given"] = _put(st.next_obs_given, given, start, ok)
        if st.next_rlt_given is not None:
            given = jnp.full((rows,), layout.has_rlt, bool)
            out["next_rlt_given"] = _put(st.next_rlt_given, given, start, ok)
        if layout.has_initial:
            at = start[:-3] + (key.epoch_id, start[-1])
            # uniform halves: only chunk zero's is written (the others' are dropped)
            first = (key.chunk_id == 0) if uniform else True
            out["initial"] = _put(st.initial, part.initial_transition.boundary(), at, ok & first)
        return st.replace(**out)

    return _commit(state, code, key, s, write)


def add_policies(plan: TrajectoryPlan, state: CollectorState, parts: PolicyPart) -> CollectorState:
    """Write a stack of policy halves (leading axis ``N`` on every leaf) in one call.

    Equivalent to ``N`` calls of :func:`add_policy` in order, in one dispatch.
    """
    return lax.scan(lambda st, p: (add_policy(plan, st, p), None), state, parts)[0]


def add_envs(plan: TrajectoryPlan, state: CollectorState, parts: EnvPart) -> CollectorState:
    """Write a stack of env halves (leading axis ``N``) in one call; see :func:`add_policies`."""
    return lax.scan(lambda st, p: (add_env(plan, st, p), None), state, parts)[0]
