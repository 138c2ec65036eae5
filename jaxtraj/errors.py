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
            names = ("step_id", "epoch_id", "env_rank", "stage_id", "chunk_id")
            msg = f"key({', '.join(f'{n}={v}' for n, v in zip(names, self.key))}): {msg}"
        if detail:
            msg = f"{msg} ({detail})"
        super().__init__(msg)

    def __reduce__(self):  # picklable: across processes (Ray actors, multiprocessing)
        return (type(self), (self.key, self.code, self.detail))


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
        raise CollectorError(
            np.asarray(state.error_key).reshape(-1, 5)[i].tolist(),
            int(codes[i]),
            f"{count} part(s) or flush(es) rejected under jit; the first is reported",
        )
