"""Key and slot arithmetic, and the checks every half must pass.

A collector owns ``S`` sources, each ``(env_rank, stage_id)``, and keeps for each
source ``E`` epochs of ``T`` chunk slots of ``B`` rows. A key maps to the slot
``(s, epoch_id, chunk_id)`` and a fragment to the rows ``[offset, offset + rows)``.

The checks are written once against an array namespace ``xp`` so the host facade
(``numpy``, concrete keys, no device sync) and the jitted pure functions
(``jax.numpy``, traced keys) reject exactly the same parts.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import TrajectorySource


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
        ((offset < 0) | (offset + rows > plan.batch_size), ErrorCode.ROWS_OUT_OF_RANGE),
    ]


def first_error(xp: Any, checks: list[tuple[Any, ErrorCode]]) -> Any:
    """The code of the first failing check, ``ErrorCode.OK`` (0) if none fails."""
    code = xp.asarray(0, dtype=np.int32)
    for bad, c in reversed(checks):
        code = xp.where(bad, xp.asarray(int(c), dtype=np.int32), code)
    return code


def env_checks(
    xp: Any,
    plan: TrajectoryPlan,
    chunk_id: Any,
    *,
    has_initial: bool,
    has_final: bool,
    has_next_obs: bool,
    needs_final: bool,
    cut: Any = False,
    has_next_rlt: bool = True,
) -> list[tuple[Any, ErrorCode]]:
    """Boundary rules of an env half: chunk zero's ``initial_transition``, the bootstrap
    value ``final_values`` on the last chunk and on any chunk that cuts an episode
    (``cut``, see :func:`cut_flags`) and, with ``collect_transitions``, the last
    chunk's next observation."""
    last = chunk_id == plan.num_chunks - 1
    return [
        ((chunk_id == 0) & (not has_initial), ErrorCode.MISSING_INITIAL_TRANSITION),
        ((chunk_id != 0) & has_initial, ErrorCode.UNEXPECTED_INITIAL_TRANSITION),
        ((last | cut) & needs_final & (not has_final), ErrorCode.MISSING_FINAL_VALUES),
        (last & plan.collect_transitions & (not has_next_obs), ErrorCode.MISSING_NEXT_OBS),
        (last & plan.enable_rlt & (not has_next_rlt), ErrorCode.MISSING_NEXT_OBS),
    ]


def cut_flags(plan: TrajectoryPlan, part: Any) -> Any:
    """The flags of actions whose reward takes a bootstrap value (``None`` if none do)."""
    tr = part.transition
    if plan.truncation_bootstrap == "truncated":
        return tr.truncations
    if plan.truncation_bootstrap == "done":
        flags = [x for x in (tr.dones, tr.terminations, tr.truncations) if x is not None]
        return flags[0] if tr.dones is not None or len(flags) < 2 else flags[0] | flags[1]
    return None


def finite_leaves(part: Any) -> list:
    """The reward and value leaves that ``nonfinite="reject"`` checks."""
    if hasattr(part, "transition"):
        tr = part.transition
        return [x for x in (tr.rewards, tr.reward_model_output, part.final_values) if x is not None]
    out = part.output
    return [x for x in (out.prev_values, out.bootstrap_values) if x is not None]


def check_payload(name: str, data: Any, buffer: Any, lead: int, key: Any = None) -> int:
    """Check a payload against its buffer's structure, trailing shapes and dtypes.

    Runs at trace time (shapes are static) so a mismatch raises before anything is
    compiled or written. Returns the payload's row count.

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
            key, ErrorCode.STRUCTURE_MISMATCH, f"{name}: structure {d_def} != plan's {b_def}"
        )
    rows = None
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(buffer)[0]]
    for path, x, b in zip(paths, d_leaves, b_leaves):
        shape = np.shape(x)
        want = tuple(b.shape[lead + 1 :])
        dtype = jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))
        if len(shape) < 1 or tuple(shape[1:]) != want or dtype != b.dtype:
            raise CollectorError(
                key,
                ErrorCode.STRUCTURE_MISMATCH,
                f"{name}{path}: got shape {tuple(shape)} dtype {dtype}, "
                f"plan has [rows, *{list(want)}] dtype {b.dtype}",
            )
        if rows is not None and shape[0] != rows:
            raise CollectorError(
                key, ErrorCode.STRUCTURE_MISMATCH, f"{name}{path}: {shape[0]} rows, others {rows}"
            )
        rows = shape[0]
    return rows if rows is not None else 0
