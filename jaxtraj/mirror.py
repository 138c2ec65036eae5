"""The facade's host record of a step (internal): what arrived, per half and row.

Checks read it instead of the device (no sync); completeness is an O(1) row count.
"""

from __future__ import annotations

import time

import numpy as np

from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import EnvPart, PolicyPart


class Mirror:
    """The facade's host record of a step: coverage per half ``[S, E, T, B]``, rows
    received per source and epoch (both halves; duplicates never count, so an epoch of
    a source is complete at ``2 * T * B``), each source's training step, and the epochs
    flushed in the current step."""

    def __init__(self, plan: TrajectoryPlan, sources: np.ndarray, step_id: int):
        self.sources = sources
        self.index = {(int(r), int(s)): i for i, (r, s) in enumerate(sources)}
        shape = (len(sources), plan.num_epochs, plan.num_chunks, plan.batch_size)
        self.rows = {PolicyPart: np.zeros(shape, bool), EnvPart: np.zeros(shape, bool)}
        self.received = np.zeros(shape[:2], np.int64)
        self.full = 2 * plan.num_chunks * plan.batch_size
        self.step = np.full((len(sources),), step_id, np.int64)
        self.flushed = np.zeros((plan.num_epochs,), bool)
        self.last_seen = np.full((len(sources),), time.monotonic())

    def mark(self, kind: type, s: int, e: int, t: int, off: int, rows: int) -> None:
        self.rows[kind][s, e, t, off : off + rows] = True
        self.received[s, e] += rows

    def take(self, rows: dict, s: np.ndarray, e: np.ndarray, n: np.ndarray) -> None:
        """Take the coverage ``rows`` a batch's checks marked (a copy of :attr:`rows`) and
        count ``n[i]`` rows received at each ``(s[i], e[i])``."""
        S, E = self.received.shape
        counts = np.bincount(s * E + e, n, S * E).astype(np.int64).reshape(S, E)
        self.rows = rows
        self.received += counts

    def recount(self) -> None:
        self.received = sum(r.sum(axis=(2, 3)) for r in self.rows.values())

    def complete(self) -> np.ndarray:
        """``[S, E]`` bool: epochs of a source both halves cover entirely."""
        return self.received == self.full

    def clear_source(self, s: int) -> None:
        for rows in self.rows.values():
            rows[s] = False
        self.received[s] = 0
        self.step[s] += 1

    def clear_all(self) -> None:
        for rows in self.rows.values():
            rows[:] = False
        self.received[:] = 0
        self.step += 1
        self.flushed[:] = False

    def state_dict(self) -> dict[str, np.ndarray]:
        return {
            "policy_rows": self.rows[PolicyPart], "env_rows": self.rows[EnvPart],
            "step": self.step, "flushed": self.flushed,
        }

    def load_state_dict(self, tree: dict) -> None:
        self.rows = {PolicyPart: np.array(tree["policy_rows"]), EnvPart: np.array(tree["env_rows"])}
        self.step, self.flushed = np.array(tree["step"]), np.array(tree["flushed"])
        self.recount()

    def missing(self) -> list[tuple[tuple[int, ...], str, int]]:
        """What the current step still waits for: ``(key, half, rows missing)`` per slot."""
        out = []
        for kind, name in ((PolicyPart, "policy"), (EnvPart, "env")):
            rows = self.rows[kind]
            for s, e, t in zip(*np.nonzero(~rows.all(axis=-1))):
                if self.flushed[e]:
                    continue
                r, st = (int(v) for v in self.sources[s])
                key = (int(self.step[s]), int(e), r, st, int(t))
                out.append((key, name, int((~rows[s, e, t]).sum())))
        return sorted(out)

    def check_stalled(self, timeout_s: float, now: float) -> None:
        """Raise ``SOURCE_TIMEOUT`` for the longest-silent source with parts missing that
        sent nothing for ``timeout_s`` seconds."""
        missing = self.missing()
        waiting = {(k[2], k[3]) for k, _, _ in missing}
        for s in np.argsort(self.last_seen, kind="stable"):  # the longest silent first
            r, st = (int(v) for v in self.sources[s])
            if (r, st) in waiting and now - self.last_seen[s] > timeout_s:
                keys = [k for k, _, _ in missing if (k[2], k[3]) == (r, st)]
                shown = ", ".join(str(k) for k in keys[:8]) + (" ..." if len(keys) > 8 else "")
                raise CollectorError(
                    (int(self.step[s]), -1, r, st, -1),
                    ErrorCode.SOURCE_TIMEOUT,
                    f"{len(keys)} halves missing after {timeout_s} s: {shown}",
                )
