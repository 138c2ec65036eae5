"""Every check a half must pass, in one home, for the host and for ``jit``.

A collector owns ``S`` sources, each ``(env_rank, stage_id)``, and keeps for each
source ``E`` epochs of ``T`` chunk slots of ``B`` rows. A key maps to the slot
``(s, epoch_id, chunk_id)`` and a fragment to the rows ``[offset, offset + rows)``.

Three kinds of check, each written once:

- structure (:func:`policy_structure`, :func:`env_structure`): the part's tree,
  trailing shapes and dtypes against the buffers, and ``K`` against the action
  chunk. Static: it runs at trace time under ``jit`` and once per part signature in
  the facade (:class:`HostChecks`).
- key and boundary rules (:func:`key_checks`, :func:`env_checks`): written against an
  array namespace ``xp``, so the host facade (:class:`py` scalars or ``numpy``
  stacks, no device sync) and the jitted pure functions (``jax.numpy``, traced keys)
  reject exactly the same parts, in the same priority order.
- data (:func:`finite_leaves`): the reward and value leaves ``nonfinite="reject"``
  checks.

Field semantics are the types': which flags cut an episode is
``EnvTransition.cut_flags``, ``K`` is :func:`jaxtraj.types.chunk_size`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import (
    EnvPart,
    EnvTransition,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
    chunk_size,
)


class py:
    """A plain-Python stand-in for ``xp`` on scalar host values: the facade checks a
    single part with it, at a fraction of numpy's per-call cost."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def asarray(x: Any, dtype: Any = None) -> int:
        return int(x)

    @staticmethod
    def logical_not(x: Any) -> bool:
        return not x


# -- structure (static) ------------------------------------------------------------------


class Layout(NamedTuple):
    """What a part's structure says: its row count and the optional fields it carries
    that the buffers retain."""

    rows: int
    has_initial: bool = False
    has_final: bool = False
    has_next: bool = False
    has_rlt: bool = False


def check_payload(name: str, data: Any, buffer: Any, lead: int, key: Any = None) -> int:
    """Check a payload against its buffer's structure, trailing shapes and dtypes.

    Runs at trace time (shapes are static) so a mismatch raises before anything is
    compiled or written. A dtype must equal the buffer's: nothing is cast silently
    (under ``jit`` JAX has already converted inputs to its canonical dtypes, e.g.
    ``float64`` to ``float32`` without x64). Returns the payload's row count.

    Args:
      name: field named in the error.
      data: the payload, leaves ``[rows, ...]``.
      buffer: its buffer, leaves ``[*lead_axes, B, ...]`` with ``lead`` leading axes
        before the rows axis.
      key: the concrete key tuple for the message, when known.
    """
    d_leaves, d_def = jax.tree.flatten(data)
    b_leaves, b_def = jax.tree.flatten(buffer)
    if d_def != b_def:
        raise CollectorError(
            key, ErrorCode.STRUCTURE_MISMATCH, f"{name}: {structure_diff(data, buffer, lead)}"
        )
    rows = None
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(buffer)[0]]
    for path, x, b in zip(paths, d_leaves, b_leaves):
        shape = np.shape(x)
        want = tuple(b.shape[lead + 1 :])
        try:
            dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))
        except TypeError:  # a string, an object: not an array of numbers
            raise CollectorError(
                key, ErrorCode.STRUCTURE_MISMATCH,
                f"{name}{path}: not an array of numbers ({type(x).__name__}), plan has "
                f"{rows_shape(want)} dtype {b.dtype}",
            ) from None
        if len(shape) < 1 or tuple(shape[1:]) != want or dtype != b.dtype:
            raise CollectorError(
                key,
                ErrorCode.STRUCTURE_MISMATCH,
                f"{name}{path}: got shape {tuple(shape)} dtype {dtype}, "
                f"plan has {rows_shape(want)} dtype {b.dtype}",
            )
        if rows is not None and shape[0] != rows:
            raise CollectorError(
                key, ErrorCode.STRUCTURE_MISMATCH, f"{name}{path}: {shape[0]} rows, others {rows}"
            )
        rows = shape[0]
    return rows if rows is not None else 0


def rows_shape(shape: Any) -> str:
    """A buffer's per-row shape as a reader writes it: ``(rows, 3)``, ``(rows,)``."""
    dims = ", ".join(str(int(d)) for d in shape)
    return f"(rows, {dims})" if dims else "(rows,)"


def structure_diff(data: Any, buffer: Any, lead: int) -> str:
    """What differs between a payload's tree and its buffer's, by field path: the fields
    missing from the payload and the extra ones, each with its shape and dtype (the
    buffer's per row); else the two tree structures (a container of another type)."""

    def described(tree, drop):
        out = {}
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            shape = tuple(np.shape(x))[drop:]
            dtype = getattr(x, "dtype", type(x).__name__)
            out[jax.tree_util.keystr(path)] = f"{rows_shape(shape)} {dtype}"
        return out

    have, want = described(data, 1), described(buffer, lead + 1)
    missing = [f"{p} (plan has {want[p]})" for p in want if p not in have]
    extra = [f"{p} ({have[p]})" for p in have if p not in want]
    parts = []
    if missing:
        parts.append("missing " + ", ".join(missing))
    if extra:
        parts.append("not in the plan's example " + ", ".join(extra))
    if not parts:
        return (
            f"structure {jax.tree.structure(data)} != plan's {jax.tree.structure(buffer)}"
        )
    return "; ".join(parts)


def check_key_dtypes(source: Any, key: Any = None) -> None:
    """Key fields, ``batch_size`` and ``offset`` must be integers (``chunk_id=1.5`` is
    not chunk 1)."""
    for name, v in zip(
        ("step_id", "epoch_id", "env_rank", "stage_id", "chunk_id", "batch_size", "offset"),
        (*source.key.fields(), source.batch_size, source.offset),
    ):
        dtype = np.dtype(v.dtype) if hasattr(v, "dtype") else np.result_type(type(v))
        if not (np.issubdtype(dtype, np.integer) and dtype != np.bool_):
            raise CollectorError(
                key, ErrorCode.STRUCTURE_MISMATCH, f"source.{name} must be an integer, got {v!r}"
            )


def expert_half(
    plan: TrajectoryPlan, state: Any, part: PolicyPart, xp: Any, key: Any = None,
    stacked: bool = False,
):
    """A policy half that lacks output fields the buffers hold (an expert's or a
    teleoperator's: not inferred): zero-filled in lerobot mode, which records what was
    executed; refused in the modes that train on log-probabilities and values."""
    missing = part.missing_outputs(state.policy.output)
    if not missing:
        return part
    if plan.mode != "lerobot":
        raise CollectorError(
            key,
            ErrorCode.STRUCTURE_MISMATCH,
            f"a policy half without PolicyOutput.{', .'.join(missing)} (an expert's or a "
            f"teleoperator's, not inferred) is taken in lerobot mode only; {plan.mode} mode "
            "trains on them",
        )
    return part.as_expert(state.policy.output, state.lead, xp, stacked)


def policy_structure(state: Any, part: PolicyPart, key: Any = None) -> Layout:
    """Check a policy half against the buffers of ``state`` (shapes only are read)."""
    if not isinstance(part, PolicyPart):
        raise CollectorError(key, ErrorCode.STRUCTURE_MISMATCH, f"not a PolicyPart: {type(part)}")
    check_key_dtypes(part.source, key)
    rows = check_payload("PolicyPart", part.replace(source=None), state.policy, state.lead, key)
    return Layout(rows)


def env_structure(state: Any, part: EnvPart, key: Any = None) -> Layout:
    """Check an env half against the buffers of ``state`` (shapes only are read):
    its payload, the optional boundary fields it carries, and its interventions and
    action-level fields against the action chunk's ``K``."""
    if not isinstance(part, EnvPart):
        raise CollectorError(key, ErrorCode.STRUCTURE_MISMATCH, f"not an EnvPart: {type(part)}")
    check_key_dtypes(part.source, key)
    lead, layout = state.lead, state.env
    optional = dict(initial_transition=None, final_values=None, next_obs=None, next_rlt_obs=None)
    if layout.action_obs is None:  # not retained (not lerobot mode, or not in the example)
        optional["action_obs"] = None
    payload = part.replace(source=None, **optional)
    rows = check_payload("EnvPart", payload, layout.replace(**optional), lead, key)
    _check_interventions(state, part.transition, key)
    check_reward_assign(part.transition, key)
    has_final = part.final_values is not None
    if has_final:
        if layout.final_values is None:
            raise CollectorError(
                key,
                ErrorCode.STRUCTURE_MISMATCH,
                "EnvPart.final_values given, but the plan's examples carry no values",
            )
        check_payload("EnvPart.final_values", part.final_values, layout.final_values, lead, key)
    # A next_obs override is part of the contract; it is only retained with collect_transitions.
    has_next = part.next_obs is not None and layout.next_obs is not None
    if has_next:
        check_payload("EnvPart.next_obs", part.next_obs, layout.next_obs, lead, key)
    has_rlt = part.next_rlt_obs is not None and layout.next_rlt_obs is not None
    if has_rlt:
        check_payload("EnvPart.next_rlt_obs", part.next_rlt_obs, layout.next_rlt_obs, lead, key)
    has_initial = part.initial_transition is not None
    if has_initial:
        check_payload(
            "EnvPart.initial_transition",
            part.initial_transition.boundary(),
            state.initial,
            lead - 1,
            key,
        )
    return Layout(rows, has_initial, has_final, has_next, has_rlt)


def _check_interventions(state: Any, tr: EnvTransition, key: Any) -> None:
    """Interventions must fit the action chunk: ``intervene_actions`` as many elements per
    row as the policy's actions, ``intervene_flags`` boolean ``[rows, K]``; every
    action-level field has the chunk's ``K``."""
    actions = state.policy.output.actions
    per_row = int(np.prod(actions.shape[state.lead + 1 :]))
    if tr.intervene_actions is not None:
        shape = np.shape(tr.intervene_actions)
        if int(np.prod(shape[1:])) != per_row:
            raise CollectorError(
                key,
                ErrorCode.STRUCTURE_MISMATCH,
                f"EnvTransition.intervene_actions: shape {tuple(shape)} does not match the "
                f"action chunk {tuple(actions.shape[state.lead + 1 :])} per row",
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
    k_state = state.actions_per_chunk
    per_row_actions = jax.ShapeDtypeStruct((1,) + actions.shape[state.lead + 1 :], actions.dtype)
    k_part = chunk_size(per_row_actions, tr, 1, key)
    if k_part != k_state:
        raise CollectorError(
            key,
            ErrorCode.STRUCTURE_MISMATCH,
            f"the part's action-level fields have {k_part} actions per chunk, the plan's "
            f"examples {k_state}",
        )


def check_reward_assign(tr: EnvTransition, key: Any = None) -> None:
    """``reward_assign_lengths`` (when given) is integer ``[rows]`` beside a
    ``reward_model_output``: the delayed score it assigns back."""
    lengths = tr.reward_assign_lengths
    if lengths is None:
        return
    if tr.reward_model_output is None:
        raise CollectorError(
            key, ErrorCode.STRUCTURE_MISMATCH,
            "EnvTransition.reward_assign_lengths without reward_model_output: a length "
            "assigns the chunk's reward-model score back, and there is none",
        )
    shape, dtype = tuple(np.shape(lengths)), np.dtype(getattr(lengths, "dtype", np.int64))
    rows = tuple(np.shape(tr.reward_model_output))[:1]
    if dtype.kind not in "iu" or shape != rows:
        raise CollectorError(
            key, ErrorCode.STRUCTURE_MISMATCH,
            f"EnvTransition.reward_assign_lengths: must be integer (rows,), one length per "
            f"row of reward_model_output {tuple(np.shape(tr.reward_model_output))}; got "
            f"{dtype} {shape}",
        )


def negative_lengths(xp: Any, tr: EnvTransition) -> Any:
    """``[rows]`` bool, the rows whose ``reward_assign_lengths`` is negative."""
    return xp.asarray(tr.reward_assign_lengths) < 0


def lengths_detail(tr: EnvTransition, bad: np.ndarray, offset: int = 0) -> str:
    """Names the rows refused by :func:`negative_lengths` and the first one's length."""
    rows = np.flatnonzero(np.asarray(bad).reshape(-1))
    shown = ", ".join(str(int(r) + offset) for r in rows[:5]) + (", ..." if rows.size > 5 else "")
    first = int(np.asarray(tr.reward_assign_lengths).reshape(-1)[rows[0]])
    return f"EnvTransition.reward_assign_lengths rows [{shown}]: {first}"


# -- key and boundary rules (xp) ---------------------------------------------------------


def locate(xp: Any, sources: Any, env_rank: Any, stage_id: Any) -> tuple[Any, Any]:
    """``(found, s)``: whether ``(env_rank, stage_id)`` is an owned source, and its index."""
    match = (sources[:, 0] == env_rank) & (sources[:, 1] == stage_id)
    return match.any(), xp.argmax(match)


def key_checks(
    xp: Any, plan: TrajectoryPlan, source: TrajectorySource, rows: int, found: Any, step: Any
) -> list[tuple[Any, ErrorCode]]:
    """Range, step and row checks of one fragment, in priority order.

    Args:
      source: the fragment's source (key, batch size, offset).
      rows: the fragment's row count (static).
      found: whether the key's source is owned.
      step: the source's current training step.
    """
    key = source.key
    offset = source.offset
    return [
        (xp.logical_not(found), ErrorCode.UNKNOWN_SOURCE),
        ((key.epoch_id < 0) | (key.epoch_id >= plan.num_epochs), ErrorCode.EPOCH_OUT_OF_RANGE),
        ((key.chunk_id < 0) | (key.chunk_id >= plan.num_chunks), ErrorCode.CHUNK_OUT_OF_RANGE),
        (key.step_id < step, ErrorCode.STALE_STEP),
        (key.step_id > step, ErrorCode.FUTURE_STEP),
        (source.batch_size != plan.batch_size, ErrorCode.BATCH_SIZE_MISMATCH),
        ((offset < 0) | (offset > plan.batch_size - rows), ErrorCode.ROWS_OUT_OF_RANGE),
    ]


def keys_pass(
    plan: TrajectoryPlan, key: Any, batch_size: Any, offset: Any, rows: int, found: Any,
    step: Any,
) -> Any:
    """Whether every rule of :func:`key_checks` passes (elementwise for arrays): the host's
    hot path tests this one expression and asks :func:`key_checks` for the code only when
    it fails. ``key`` is ``(step_id, epoch_id, env_rank, stage_id, chunk_id)``."""
    step_id, e, _, _, t = key
    return (found & (e >= 0) & (e < plan.num_epochs) & (t >= 0) & (t < plan.num_chunks)
            & (step_id == step) & (batch_size == plan.batch_size) & (offset >= 0)
            & (offset <= plan.batch_size - rows))


def first_error(xp: Any, checks: list[tuple[Any, ErrorCode]]) -> Any:
    """The code of the first failing check, ``ErrorCode.OK`` (0) if none fails."""
    if xp is py:  # scalars: stop at the first failure
        for bad, c in checks:
            if bad:
                return int(c)
        return 0
    code = xp.asarray(0, dtype=np.int32)
    for bad, c in reversed(checks):  # c: a code, or an array of codes per element
        c = xp.asarray(c, dtype=np.int32) if isinstance(c, np.ndarray) else int(c)
        code = xp.where(bad, xp.asarray(c, dtype=np.int32), code)
    return code


def env_checks(
    xp: Any,
    plan: TrajectoryPlan,
    chunk_id: Any,
    layout: Layout,
    *,
    needs_final: bool,
    cut: Any = False,
) -> list[tuple[Any, ErrorCode]]:
    """Boundary rules of an env half: chunk zero's ``initial_transition``, the bootstrap
    value ``final_values`` on the last chunk and on any chunk that cuts an episode
    (``cut``: any of ``EnvTransition.cut_flags``), and the last chunk's next state
    with ``collect_transitions`` (``next_obs``) and ``enable_rlt`` (``next_rlt_obs``)."""
    last = chunk_id == plan.num_chunks - 1
    return [
        ((chunk_id == 0) & (not layout.has_initial), ErrorCode.MISSING_INITIAL_TRANSITION),
        ((chunk_id != 0) & layout.has_initial, ErrorCode.UNEXPECTED_INITIAL_TRANSITION),
        ((last | cut) & needs_final & (not layout.has_final), ErrorCode.MISSING_FINAL_VALUES),
        (last & plan.collect_transitions & (not layout.has_next), ErrorCode.MISSING_NEXT_OBS),
        (last & plan.enable_rlt & (not layout.has_rlt), ErrorCode.MISSING_NEXT_OBS),
    ]


def cut_any(xp: Any, plan: TrajectoryPlan, part: EnvPart, n: int | None = None) -> Any:
    """Whether any action of the part (or, stacked, of each of its ``n`` parts) cuts an
    episode under ``plan.truncation_bootstrap``."""
    flags = part.transition.cut_flags(plan.truncation_bootstrap, xp)
    if n is None:
        return False if flags is None else xp.any(flags)
    if flags is None:
        return np.zeros((n,), bool)
    return np.asarray(flags).reshape(n, -1).any(axis=1)


def invalid_action_rows(xp: Any, transition: EnvTransition, rows_ndim: int = 1) -> Any:
    """``[...]`` bool, the rows whose ``valid_actions`` break the chunk-end rule (all false
    without ``valid_actions``).

    With ``r_j`` the mask and ``d_j`` the action's done flag (a chunk-level done falls on
    the last action that ran), a row is refused when

    - a run of actions that ran stops before the chunk's end at an action not flagged
      done (``r_j & ~r_{j+1} & ~d_j``);
    - an action is valid right after one flagged done (``d_j & r_{j+1}``): a chunk cut at
      an end runs nothing after it;
    - a run starts after a gap that is not a reset step: action ``j + 1`` ran, ``j`` did
      not, and ``j`` neither starts the chunk nor follows a done (EnvPool's reset step);
    - an action that did not run carries a done flag or a nonzero reward.
    """
    tr = transition
    if tr.valid_actions is None:
        return False
    if xp is np and np.all(tr.valid_actions):  # hot on the host: every action ran, so
        # only an action right after a done (a done before the last action) breaks it
        dones = tr.resolved_dones(np)
        rows = np.shape(tr.valid_actions)[:-1]
        if dones is None or np.ndim(dones) <= rows_ndim:  # none, or on the last action
            return np.zeros(rows, bool)
        return np.asarray(dones)[..., :-1].any(axis=-1)
    ran = xp.asarray(tr.valid_actions).astype(bool)
    K = ran.shape[-1]
    dones = tr.resolved_dones(xp)
    if dones is None:
        dones = xp.zeros(ran.shape, bool)
    elif np.ndim(dones) <= rows_ndim:  # chunk-level: on the last action that ran
        last = (xp.cumsum(ran[..., ::-1], axis=-1) == 1)[..., ::-1] & ran
        dones = last & xp.asarray(dones, bool)[..., None]
    dones = xp.asarray(dones).astype(bool)
    bad = dones & ~ran
    if tr.rewards is not None and np.ndim(tr.rewards) > rows_ndim:
        bad = bad | ((xp.asarray(tr.rewards) != 0) & ~ran)
    bad = xp.any(bad, axis=-1)
    if K > 1:
        now, nxt = ran[..., :-1], ran[..., 1:]
        d_now = dones[..., :-1]
        stops = now & ~nxt & ~d_now
        after_done = d_now & nxt
        # a start at j + 1 after a gap at j: fine at j = 0, or when j follows a done
        follows_done = xp.concatenate([xp.ones(ran.shape[:-1] + (1,), bool), dones[..., :-2]],
                                      axis=-1)
        gap = ~now & nxt & ~follows_done
        bad = bad | xp.any(stops | after_done | gap, axis=-1)
    return bad


def mask_detail(transition: EnvTransition, bad: np.ndarray, offset: int = 0) -> str:
    """Names the first refused row of ``valid_actions`` and shows it beside its dones."""
    rows = np.flatnonzero(np.asarray(bad).reshape(-1))
    r = int(rows[0])
    mask = np.asarray(transition.valid_actions, bool)[r].astype(int).tolist()
    dones = transition.resolved_dones(np)
    shown = "" if dones is None else f", dones {np.asarray(dones, bool)[r].astype(int).tolist()}"
    more = f" (and {rows.size - 1} more rows)" if rows.size > 1 else ""
    return f"EnvTransition.valid_actions row {r + offset}: {mask}{shown}{more}"


def finite_fields(part: Any) -> list[tuple[str, Any]]:
    """The reward and value fields that ``nonfinite="reject"`` checks, by name."""
    if isinstance(part, EnvPart):
        tr = part.transition
        named = (("EnvTransition.rewards", tr.rewards),
                 ("EnvTransition.reward_model_output", tr.reward_model_output),
                 ("EnvPart.final_values", part.final_values))
    else:
        out = part.output
        named = (("PolicyOutput.prev_values", out.prev_values),
                 ("PolicyOutput.bootstrap_values", out.bootstrap_values))
    return [(n, x) for n, x in named if x is not None]


def finite_leaves(part: Any) -> list:
    """The reward and value leaves that ``nonfinite="reject"`` checks."""
    return [x for _, x in finite_fields(part)]


def nonfinite_detail(part: Any, offset: int = 0) -> str:
    """Names the first non-finite field of a part, its rows and (per action) actions."""
    for name, x in finite_fields(part):
        x = np.asarray(x)
        bad = ~np.isfinite(x)
        if not bad.any():
            continue
        rows = np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1)) + offset
        shown = ", ".join(str(int(r)) for r in rows[:5]) + (", ..." if rows.size > 5 else "")
        where = f"{name} rows [{shown}]"
        if bad.ndim >= 2:
            first = np.argwhere(bad)[0]
            actions = np.flatnonzero(bad[first[0]].reshape(bad.shape[1], -1).any(axis=1))
            where += f" (row {int(first[0]) + offset}: action {', '.join(map(str, actions))})"
        value = x[tuple(np.argwhere(bad)[0])]
        return f"{where}: {value}"
    return ""


# -- the host side ---------------------------------------------------------------------


class Signature(NamedTuple):
    """What a part's signature (tree, shapes, dtypes) tells the host checks, once."""

    layout: Layout
    finite: tuple[int, ...]  # leaves that nonfinite="reject" checks
    cut: tuple[int, ...] | None  # leaves whose any() cuts an episode (None: a policy half)
    boundary: np.ndarray | None  # an env half's boundary codes (HostChecks._boundary)


class _Pair:
    """An ``xp`` that records which leaves a rule combines instead of combining them."""

    @staticmethod
    def logical_or(a: Any, b: Any) -> tuple:
        return (a, b)


class _Key(NamedTuple):
    step_id: int
    epoch_id: int
    env_rank: int
    stage_id: int
    chunk_id: int


class _Source(NamedTuple):
    key: _Key
    batch_size: int
    offset: int


class HostChecks:
    """The facade's checks: the same rules on concrete host values, against a numpy
    mirror of the coverage masks (no device sync; a rejected part changes nothing).

    A part is flattened once; what its signature implies (structure, which leaves hold
    rewards and values, which flags cut an episode) is worked out once per signature.

    Args:
      plan: the plan.
      layout: a state (or its ``jax.eval_shape``) with the buffers' shapes, one source.
      sources: ``[S, 2]`` the owned ``(env_rank, stage_id)`` in source-index order.
    """

    def __init__(self, plan: TrajectoryPlan, layout: Any, sources: np.ndarray):
        self.plan, self.layout, self.sources = plan, layout, sources
        self.index = {(int(r), int(s)): i for i, (r, s) in enumerate(sources)}
        self.needs_final = layout.policy.output.prev_values is not None
        self._seen: dict[Any, Signature] = {}
        self._tables: dict[Layout, np.ndarray] = {}  # env halves' boundary codes (_boundary)

    def signature(
        self, part: Any, leaves: list, treedef: Any, stacked: bool = False, key: Any = None
    ) -> Signature:
        """Structure check and what follows from it, cached by the part's signature."""
        try:  # hot: the source's seven scalars by type, the payload's arrays by shape and dtype
            sig = (treedef, stacked, *map(type, leaves[:7]), *[(x.shape, x.dtype) for x in leaves[7:]])
        except AttributeError:  # a payload leaf that is not an array: the slow, general path
            try:
                sig = (treedef, stacked, *[(np.shape(x), np.result_type(x)) for x in leaves])
            except TypeError:  # not numbers at all: the structure check says which leaf
                sig = None
        found = self._seen.get(sig)
        if found is None:
            if not isinstance(part, (PolicyPart, EnvPart)):
                raise CollectorError(key, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
            view = part
            if stacked:  # check one element of the stack (a Python int is an integer,
                # however large: the key rules judge its value)
                dtype = lambda x: np.dtype(np.int64) if type(x) is int else np.asarray(x).dtype
                view = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], dtype(x)), part)
            probe = jax.tree.unflatten(treedef, range(len(leaves)))  # leaves: their indices
            if isinstance(part, PolicyPart):
                layout, cut = policy_structure(self.layout, view, key), None
            else:
                layout = env_structure(self.layout, view, key)
                flags = probe.transition.cut_flags(self.plan.truncation_bootstrap, _Pair)
                cut = tuple(jax.tree.leaves(flags))
            boundary = None if cut is None else self._boundary(layout)
            found = Signature(layout, tuple(finite_leaves(probe)), cut, boundary)
            if sig is not None:
                self._seen[sig] = found
        return found

    def _boundary(self, layout: Layout) -> np.ndarray:
        """``int32[2, 2, 2]``: an env half's boundary code by (first chunk, last chunk, cut),
        worked out once per layout from the rules themselves at a chunk of each kind."""
        table = self._tables.get(layout)
        if table is None:
            T = self.plan.num_chunks
            table = self._tables[layout] = np.zeros((2, 2, 2), np.int32)
            for t in {0, T - 1, min(1, T - 1)}:  # the first, the last, one between
                for cut in (False, True):
                    rules = env_checks(py, self.plan, t, layout, needs_final=self.needs_final,
                                       cut=cut)
                    table[int(t == 0), int(t == T - 1), int(cut)] = first_error(py, rules)
        return table

    def structure(self, part: Any, stacked: bool = False, key: Any = None) -> Layout:
        """Structure check (cached by signature)."""
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise CollectorError(key, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
        leaves, treedef = jax.tree.flatten(part)
        return self.signature(part, leaves, treedef, stacked, key).layout

    def one(self, part: Any, rows_mask: np.ndarray, step: np.ndarray) -> tuple:
        """Check one part; return ``(s, epoch, chunk, offset, layout, leaves, treedef)``
        (its flattened leaves: a source's seven, then the payload's).

        Args:
          rows_mask: ``[S, E, T, B]`` the mirror of this half's coverage.
          step: ``[S]`` the sources' current training steps.
        Raises:
          CollectorError: the part is rejected.
        """
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise CollectorError(None, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
        leaves, treedef = jax.tree.flatten(part)
        if tuple(map(type, leaves[:7])) == _INTS:  # hot: plain Python ints
            key, bs, off = tuple(leaves[:5]), leaves[5], leaves[6]
        else:
            key = tuple(_scalar(v, n) for v, n in zip(leaves[:5], _FIELDS))
            bs, off = _scalar(leaves[5], "batch_size"), _scalar(leaves[6], "offset")
        info = self.signature(part, leaves, treedef, False, key)
        layout, rows, plan = info.layout, info.layout.rows, self.plan
        e, t = key[1], key[4]
        s = self.index.get((key[2], key[3]))
        # Every key rule at once; only a part that fails one is run through the rules in
        # their priority order (the same rules, the same code, for the error).
        if s is None or not keys_pass(plan, key, bs, off, rows, True, int(step[s])):
            found, s = s is not None, s or 0
            rules = key_checks(py, plan, _Source(_Key(*key), bs, off), rows, found, int(step[s]))
            raise CollectorError(key, first_error(py, rules))
        if np.count_nonzero(rows_mask[s, e, t, off : off + rows]):  # faster than any()
            raise CollectorError(key, ErrorCode.DUPLICATE)
        if info.cut is not None:  # an env half: its boundary rules, by what decides them
            cut = any(np.count_nonzero(leaves[i]) for i in info.cut)
            code = info.boundary[int(t == 0), int(t == plan.num_chunks - 1), int(cut)]
            if code:
                raise CollectorError(key, code)
        if info.finite and plan.nonfinite == "reject":
            for i in info.finite:
                if not np.isfinite(leaves[i]).all():
                    raise CollectorError(key, ErrorCode.NON_FINITE, nonfinite_detail(part, off))
        if info.cut is not None and part.transition.valid_actions is not None:
            bad = invalid_action_rows(np, part.transition)
            if np.any(bad):
                raise CollectorError(key, ErrorCode.INVALID_ACTION_MASK,
                                     mask_detail(part.transition, bad, off))
        if info.cut is not None and part.transition.reward_assign_lengths is not None:
            bad = negative_lengths(np, part.transition)
            if np.any(bad):
                raise CollectorError(key, ErrorCode.INVALID_REWARD_ASSIGN,
                                     lengths_detail(part.transition, bad, off))
        return s, e, t, off, layout, leaves, treedef

    def many(
        self, parts: list, rows: dict, step: np.ndarray, places: list | None = None
    ) -> list[tuple]:
        """Check parts one after another against ``rows`` (the mirror's coverage per half,
        a copy: marked as they pass, so rows repeated within the batch are duplicates);
        return what :meth:`one` returns for each.

        ``places``: each part's place in the caller's batch (default its index here).

        Raises:
          CollectorError: for the first rejected part, naming its place in the batch.
        """
        checked = []
        for n, part in enumerate(parts):
            try:
                found = self.one(part, rows.get(type(part)), step)
            except CollectorError as err:
                place = f"part {n if places is None else places[n]} of the batch"
                detail = f"{err.detail}; {place}" if err.detail else place
                raise CollectorError(err.key, err.code, detail) from None
            s, e, t, off, layout = found[:5]
            rows[type(part)][s, e, t, off : off + layout.rows] = True
            checked.append(found)
        return checked

    def stack(
        self, part: Any, rows_mask: np.ndarray, step: np.ndarray, places: list | None = None
    ) -> np.ndarray:
        """Check a stack of parts (a leading axis ``N``) and mark their rows in
        ``rows_mask``; return their source indices ``[N]`` and their :class:`Layout`.

        Rows repeated within the stack are duplicates too. Raises ``CollectorError``
        for the first rejected part (named by its place in the caller's batch when
        ``places`` gives them); ``rows_mask`` is then unchanged.
        """
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise CollectorError(None, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
        leading = jax.tree.leaves((part.source.key, part.replace(source=None)))
        sizes = {np.shape(x)[:1] for x in leading}
        if len(sizes) != 1 or () in sizes:  # batch_size and offset may be scalars
            raise CollectorError(
                None, ErrorCode.STRUCTURE_MISMATCH,
                f"a stacked part needs one leading axis N on its keys and payload leaves, "
                f"got {sorted(sizes)}",
            )
        src = part.source
        first = f"part {0 if places is None else places[0]} of the batch"
        # Integer keys, by dtype (an object or float array is refused whatever it holds), as
        # int64 (uint64 beyond int64 clipped: still out of range, as the value is).
        ints = [_int64s(v, name, first) for name, v in zip(
            (*_FIELDS, "batch_size", "offset"), (*src.key.fields(), src.batch_size, src.offset))]
        keys = np.stack(ints[:5], axis=1)
        try:
            layout = self.structure(part, True, None)
        except CollectorError as err:  # the stack shares its structure: name its first part
            key = tuple(int(k) for k in keys[0]) if len(keys) else None
            raise CollectorError(key, err.code, f"{err.detail}; {first}") from None
        n, rows = keys.shape[0], layout.rows
        if not n:
            return np.zeros((0,), np.int64), layout  # an empty stack: nothing to insert
        bs, off = np.broadcast_to(ints[5], (n,)), np.broadcast_to(ints[6], (n,))
        match = (self.sources[None, :, 0] == keys[:, 2:3]) & (
            self.sources[None, :, 1] == keys[:, 3:4]
        )
        found, s = match.any(axis=1), match.argmax(axis=1)
        # Every key rule at once; the rules in their priority order only when one fails.
        plan = self.plan
        valid = keys_pass(plan, keys.T, bs, off, rows, found, step[s])
        rules = []
        failed = not valid.all()
        if failed:
            source = TrajectorySource(TrajectoryKey(*keys.T), bs, off)
            rules = key_checks(np, plan, source, rows, found, step[s])
            valid = first_error(np, rules) == 0
        e, t = np.where(valid, keys[:, 1], 0), np.where(valid, keys[:, 4], 0)
        o = np.where(valid, off, 0)
        # Flat indices of every row into the (contiguous) coverage mask.
        S, E, T, B = rows_mask.shape
        flat = (((s * E + e) * T + t) * B + o)[:, None] + np.arange(rows)
        if not rows_mask.flags.c_contiguous:  # the marks must land in the caller's mask
            raise ValueError("the coverage mask must be C-contiguous")
        mask = rows_mask.reshape(-1)  # a view
        dup = mask[flat].any(axis=1)
        # Rows repeated within the stack: every occurrence after the first is a duplicate.
        # Every part covers `rows` consecutive places, so two overlap exactly when their
        # first places, sorted, are closer than `rows`: a sort of N finds whether any do;
        # only then does np.unique say which.
        starts = np.sort(flat[valid, 0]) if rows else np.zeros(0, np.int64)
        if starts.size > 1 and (np.diff(starts) < rows).any():
            ids = np.where(valid[:, None], flat, -1 - np.arange(n)[:, None])
            _, first = np.unique(ids.ravel(), return_index=True)
            seen_first = np.zeros(ids.size, bool)
            seen_first[first] = True
            dup |= ~seen_first.reshape(ids.shape).all(axis=1)
        rules.append((dup, ErrorCode.DUPLICATE))
        failed = failed or dup.any()
        if isinstance(part, EnvPart):  # the boundary rules' code per part, from the table
            t = keys[:, 4]
            boundary = self._boundary(layout)[
                (t == 0).astype(np.intp), (t == plan.num_chunks - 1).astype(np.intp),
                cut_any(np, plan, part, n).astype(np.intp),
            ]
            rules.append((boundary != 0, boundary))
            failed = failed or boundary.any()
        if plan.nonfinite == "reject":
            finite = np.ones((n,), bool)
            for x in finite_leaves(part):
                finite &= np.isfinite(np.asarray(x)).reshape(n, -1).all(axis=1)
            rules.append((~finite, ErrorCode.NON_FINITE))
            failed = failed or not finite.all()
        masked = None
        if isinstance(part, EnvPart) and part.transition.valid_actions is not None:
            masked = np.asarray(invalid_action_rows(np, part.transition, rows_ndim=2))
            rules.append((masked.any(axis=1), ErrorCode.INVALID_ACTION_MASK))
            failed = failed or masked.any()
        negative = None
        if isinstance(part, EnvPart) and part.transition.reward_assign_lengths is not None:
            negative = np.asarray(negative_lengths(np, part.transition)).reshape(n, -1)
            rules.append((negative.any(axis=1), ErrorCode.INVALID_REWARD_ASSIGN))
            failed = failed or negative.any()
        if failed:
            code = first_error(np, rules)
            bad = np.flatnonzero(code)
            i = bad[0]
            where = f"part {i} of its group" if places is None else f"part {places[i]} of the batch"
            if code[i] == ErrorCode.INVALID_ACTION_MASK:
                one = jax.tree.map(lambda x: np.asarray(x)[i], part.transition)
                where = f"{mask_detail(one, masked[i], int(off[i]))}; {where}"
            elif code[i] == ErrorCode.INVALID_REWARD_ASSIGN:
                one = jax.tree.map(lambda x: np.asarray(x)[i], part.transition)
                where = f"{lengths_detail(one, negative[i], int(off[i]))}; {where}"
            elif code[i] == ErrorCode.NON_FINITE:
                one = jax.tree.map(lambda x: np.asarray(x)[i], part.replace(source=None))
                where = f"{nonfinite_detail(one, int(off[i]))}; {where}"
            raise CollectorError(keys[i], code[i], where)
        mask[flat] = True
        return s, layout


_FIELDS = ("step_id", "epoch_id", "env_rank", "stage_id", "chunk_id")
_INTS = (int,) * 7
_INT64 = np.iinfo(np.int64)


def _int64s(v: Any, name: str, where: str) -> np.ndarray:
    """A stack's key field as int64; anything but integers raises, naming the field."""
    if isinstance(v, int) and not isinstance(v, bool):  # a Python int (batch_size, offset)
        return np.asarray(min(max(v, _INT64.min), _INT64.max), np.int64)
    a = np.asarray(v)
    if a.dtype.kind not in "iu":
        raise CollectorError(
            None, ErrorCode.STRUCTURE_MISMATCH,
            f"source.{name} must be an integer, got dtype {a.dtype}; {where}",
        )
    if a.dtype == np.uint64:
        a = np.minimum(a, np.uint64(_INT64.max))
    return a.astype(np.int64, copy=False)


def _scalar(v: Any, name: str) -> int:
    """A host integer from a source field; anything else raises, naming the field."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return int(v)
    a = np.asarray(v)
    if a.ndim or not np.issubdtype(a.dtype, np.integer):
        raise CollectorError(
            None, ErrorCode.STRUCTURE_MISMATCH, f"source.{name} must be an integer, got {v!r}"
        )
    return int(a)
