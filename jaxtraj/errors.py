"""Error codes recorded by the pure functions and the exception the facade raises.

Under ``jit`` nothing can raise on a traced value, so the pure functions of
:mod:`jaxtraj.joiner` and :mod:`jaxtraj.modes` leave the state's data untouched
for an offending part and record an :class:`ErrorCode` (the first one wins) with
the offending key in the state. :func:`raise_if_error` turns that record into a
:class:`CollectorError` on the host; the facade raises the same error before it
ever calls the device.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np


class ErrorCode(enum.IntEnum):
    """Why a part or a flush was rejected. ``OK`` is zero."""

    OK = 0
    UNKNOWN_SOURCE = 1
    EPOCH_OUT_OF_RANGE = 2
    CHUNK_OUT_OF_RANGE = 3
    STALE_STEP = 4
    FUTURE_STEP = 5
    BATCH_SIZE_MISMATCH = 6
    ROWS_OUT_OF_RANGE = 7
    DUPLICATE = 8
    MISSING_INITIAL_TRANSITION = 9
    UNEXPECTED_INITIAL_TRANSITION = 10
    MISSING_FINAL_VALUES = 11
    MISSING_NEXT_OBS = 12
    NON_FINITE = 13
    INCOMPLETE_SCOPE = 14
    STRUCTURE_MISMATCH = 15
    EPISODE_OVERFLOW = 16
    SOURCE_TIMEOUT = 17
    INVALID_ACTION_MASK = 18
    INVALID_REWARD_ASSIGN = 19


_REASONS = {
    ErrorCode.UNKNOWN_SOURCE: "unknown source: (env_rank, stage_id) is not one this collector owns",
    ErrorCode.EPOCH_OUT_OF_RANGE: "epoch_id outside capacity [0, num_epochs)",
    ErrorCode.CHUNK_OUT_OF_RANGE: "chunk_id outside capacity [0, num_chunks)",
    ErrorCode.STALE_STEP: "stale step_id: older than the source's current training step",
    ErrorCode.FUTURE_STEP: "future step_id: newer than the source's current training step",
    ErrorCode.BATCH_SIZE_MISMATCH: "source batch_size differs from the plan's batch_size",
    ErrorCode.ROWS_OUT_OF_RANGE: "fragment rows [offset, offset + rows) fall outside [0, batch_size)",
    ErrorCode.DUPLICATE: "duplicate: these rows of this half were already received",
    ErrorCode.MISSING_INITIAL_TRANSITION: "chunk 0's env half must carry initial_transition",
    ErrorCode.UNEXPECTED_INITIAL_TRANSITION: "only chunk 0's env half may carry initial_transition",
    ErrorCode.MISSING_FINAL_VALUES: (
        "missing final_values: the last chunk's env half must carry the bootstrap value "
        "V(s_T), and a chunk that truncates an episode the value V(final obs) (a runner "
        "computes them with its value_fn from EnvStep.final_obs)"
    ),
    ErrorCode.MISSING_NEXT_OBS: (
        "the last chunk's env half must carry the next state: next_obs (collect_transitions) "
        "and next_rlt_obs (enable_rlt)"
    ),
    ErrorCode.NON_FINITE: "non-finite rewards or values",
    ErrorCode.INCOMPLETE_SCOPE: "flush of an incomplete scope",
    ErrorCode.SOURCE_TIMEOUT: "a source stopped reporting: parts still missing after the timeout",
    ErrorCode.EPISODE_OVERFLOW: "an episode is longer than the plan's max_episode_length",
    ErrorCode.STRUCTURE_MISMATCH: "part structure, shape or dtype differs from the plan's example",
    ErrorCode.INVALID_ACTION_MASK: (
        "EnvTransition.valid_actions is not a chunk cut at an episode end: the actions that "
        "ran must be one run (a leading run, or one after EnvPool's reset step at the "
        "chunk's start or right after a done), ending only at an action flagged done, with "
        "no action valid right after a done and no flag or reward on an action that did "
        "not run"
    ),
    ErrorCode.INVALID_REWARD_ASSIGN: (
        "EnvTransition.reward_assign_lengths must be >= 0: how many chunks of the row, "
        "this one included, the delayed reward-model score is assigned to"
    ),
}


def reason(code: int) -> str:
    """The human-readable reason for an error code."""
    return _REASONS.get(ErrorCode(int(code)), "ok")


class CollectorError(Exception):
    """A part or a flush was rejected. Nothing already collected was changed.

    Attributes:
      key: the offending ``TrajectoryKey`` as a tuple
        ``(step_id, epoch_id, env_rank, stage_id, chunk_id)``, or ``None``.
      code: the :class:`ErrorCode`.
      detail: what the message adds to the code's reason (the field, the part's place
        in a batch), or ``""``.
    """

    def __init__(self, key: Any, code: ErrorCode | int, detail: str = ""):
        self.key = None if key is None else tuple(int(k) for k in key)
        self.code = ErrorCode(int(code))
        self.detail = detail
        msg = f"{self.code.name}: {reason(self.code)}"
        if self.key is not None:
            msg = f"{describe_key(self.key)}: {msg}"
        if detail:
            msg = f"{msg} ({detail})"
        super().__init__(msg)

    def __reduce__(self):  # picklable: across processes (Ray actors, multiprocessing)
        return (type(self), (self.key, self.code, self.detail))


_FIELDS = ("step_id", "epoch_id", "env_rank", "stage_id", "chunk_id")


def describe_key(key: Any) -> str:
    """A key as a message names it: ``key(step_id=.., ...)`` for a chunk; a completion
    scope (fields ``-1``: any) by what it is: ``training step 0 of source (env_rank=0,
    stage_id=0)``, ``epoch 1 of training step 0 (every source)``."""
    k = tuple(int(v) for v in key)
    if min(k) >= 0:
        return f"key({', '.join(f'{n}={v}' for n, v in zip(_FIELDS, k))})"
    step, epoch, rank, stage, chunk = k
    if chunk < 0 and epoch < 0 and rank >= 0 and stage >= 0:
        return f"training step {step} of source (env_rank={rank}, stage_id={stage})"
    if chunk < 0 and epoch >= 0 and rank < 0 and stage < 0:
        return f"epoch {epoch} of training step {step} (every source)"
    given = ", ".join(f"{n}={v}" for n, v in zip(_FIELDS, k) if v >= 0)
    return f"scope({given})"


def waits_for(left: list, shown: int = 3) -> str:
    """What a scope still waits for, cut short: ``left`` is ``[(key, half, rows)]`` (as
    ``TrajectoryCollector.missing()`` lists them)."""
    if not left:
        return "nothing is missing: it was flushed already"
    first = "; ".join(
        f"{half} half of key {k} ({rows} row{'s' if rows != 1 else ''})"
        for k, half, rows in left[:shown]
    )
    more = f"; and {len(left) - shown} more (collector.missing() lists them)"
    return f"waits for {len(left)} halves: {first}{more if len(left) > shown else ''}"


def _state_missing(state: Any, key: tuple) -> list:
    """``[(key, half, rows)]`` a state's scope ``key`` (fields ``-1``: any) still lacks."""
    sources = np.asarray(state.sources).reshape(-1, 2)
    step = np.asarray(state.step).reshape(-1)
    rows = {h: np.asarray(getattr(state, f"{h}_rows")) for h in ("policy", "env")}
    rows = {h: r.reshape((-1,) + r.shape[-3:]) for h, r in rows.items()}  # [S, E, T, B]
    out = []
    for half, got in rows.items():
        for s, e, t in zip(*np.nonzero(~got.all(axis=-1))):
            k = (int(step[s]), int(e), int(sources[s, 0]), int(sources[s, 1]), int(t))
            if all(want < 0 or v == want for v, want in zip(k, key)):
                out.append((k, half, int((~got[s, e, t]).sum())))
    return sorted(out)


def raise_if_error(state: Any) -> None:
    """Raise the :class:`CollectorError` recorded in a collector state, if any.

    A jitted loop carries the state and checks once, outside ``jit``::

        state = jax.jit(loop)(state)
        jaxtraj.raise_if_error(state)   # one host sync

    ``state.error_count`` counts every rejected part; the error raised is the first
    (of the first source with one, for a stacked state).
    """
    codes = np.asarray(state.error_code).reshape(-1)
    bad = np.flatnonzero(codes)
    if bad.size:
        i = bad[0]
        count = int(np.asarray(state.error_count).sum())
        key = np.asarray(state.error_key).reshape(-1, 5)[i].tolist()
        detail = f"{count} part(s) or flush(es) rejected under jit; the first is reported"
        if int(codes[i]) == ErrorCode.INCOMPLETE_SCOPE:
            detail = f"{waits_for(_state_missing(state, tuple(key)))}; {detail}"
        raise CollectorError(key, int(codes[i]), detail)
