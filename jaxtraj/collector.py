"""``TrajectoryCollector``: the thin host facade over the pure functions.

For service loops that are not jitted (host threads, Ray-style actors): it holds the
state, checks every half on the host before it reaches the device (a numpy mirror
of the coverage masks, so rejecting a part costs no device sync and changes
nothing), raises :class:`jaxtraj.CollectorError` naming the key and the reason, and
returns queue-ready ``(queue_key, item)`` pairs when a scope completes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxtraj import joiner, rollout, slots
from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import EnvPart, PolicyPart, Trajectory

_jit = functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
_add_policy = _jit(joiner.add_policy)
_add_env = _jit(joiner.add_env)
_add_policies = _jit(joiner.add_policies)
_add_envs = _jit(joiner.add_envs)
_flush = _jit(rollout.flush)


def _host_int(x: Any) -> int:
    return int(np.asarray(x))


class TrajectoryCollector:
    """Holds a collector state; accepts either half; flushes complete scopes.

    Example::

        collector = jaxtraj.TrajectoryCollector(plan, policy_example, env_example)
        for part in arrivals:                    # any order, any fragmentation
            for queue_key, trajectory in collector.add(part):
                actor_queue[queue_key].put(trajectory)

    Args:
      plan: the static :class:`TrajectoryPlan` (``mode="rollout"``).
      policy_example, env_example: one example of each half; fixes the buffers'
        structure, trailing shapes and dtypes.
      sources: ``(env_rank, stage_id)`` pairs owned; default all of the plan's.
      step_id: the first training step.
      auto_flush: flush each source as soon as its step completes (``add`` returns
        the items); otherwise call :meth:`flush`.
    """

    def __init__(
        self,
        plan: TrajectoryPlan,
        policy_example: PolicyPart,
        env_example: EnvPart,
        *,
        sources: Sequence[tuple[int, int]] | None = None,
        step_id: int = 0,
        auto_flush: bool = True,
    ):
        if plan.mode != "rollout":
            raise ValueError(f"TrajectoryCollector supports mode='rollout', got {plan.mode!r}")
        self.plan = plan
        self.auto_flush = auto_flush
        self._state = joiner.init(
            plan, policy_example, env_example, sources=sources, step_id=step_id
        )
        self._sources = np.asarray(self._state.sources)
        shape = self._state.policy_rows.shape
        self._rows = {PolicyPart: np.zeros(shape, bool), EnvPart: np.zeros(shape, bool)}
        self._step = np.full((shape[0],), step_id, np.int64)
        self._needs_final = self._state.policy.output.prev_values is not None

    @property
    def state(self) -> joiner.CollectorState:
        """The current :class:`CollectorState` (for checkpointing or jitted use)."""
        return self._state

    def current_step(self, env_rank: int = 0, stage_id: int = 0) -> int:
        """The training step a source currently accepts."""
        return int(self._step[self._index(env_rank, stage_id)])

    def _index(self, env_rank: int, stage_id: int) -> int:
        found, s = slots.locate(np, self._sources, env_rank, stage_id)
        if not found:
            raise CollectorError(None, ErrorCode.UNKNOWN_SOURCE, f"({env_rank}, {stage_id})")
        return int(s)

    def _check(self, part: Any, rows_mirror: dict) -> tuple[int, int, int, int, int]:
        """Host-side checks of one half against ``rows_mirror``; returns its slot and rows."""
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise CollectorError(None, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
        src = part.source
        key = src.key.as_tuple()
        src = src.replace(
            key=type(src.key)(*key),
            batch_size=_host_int(src.batch_size),
            offset=_host_int(src.offset),
        )
        if isinstance(part, PolicyPart):
            rows = joiner.policy_structure(self._state, part, key)
        else:
            rows, has_initial, has_final, has_next = joiner.env_structure(self._state, part, key)
        found, s = slots.locate(np, self._sources, src.key.env_rank, src.key.stage_id)
        s = int(s)
        checks = slots.key_checks(np, self.plan, src, rows, found, self._step[s])
        e, t, off = src.key.epoch_id, src.key.chunk_id, src.offset
        mask = rows_mirror[type(part)]
        in_range = not slots.first_error(np, checks)
        dup = in_range and bool(mask[s, e, t, off : off + rows].any())
        checks.append((dup, ErrorCode.DUPLICATE))
        if isinstance(part, EnvPart):
            checks += slots.env_checks(
                np,
                self.plan,
                t,
                has_initial=has_initial,
                has_final=has_final,
                has_next_obs=has_next or not self.plan.collect_transitions,
                needs_final=self._needs_final,
            )
        if self.plan.nonfinite == "reject":
            finite = all(np.isfinite(np.asarray(x)).all() for x in slots.finite_leaves(part))
            checks.append((not finite, ErrorCode.NON_FINITE))
        code = int(slots.first_error(np, checks))
        if code:
            raise CollectorError(key, code)
        return s, e, t, off, rows

    def add(self, part: PolicyPart | EnvPart) -> list[tuple[str, Trajectory]]:
        """Insert one half (or fragment).

        Returns:
          ``(queue_key, Trajectory)`` pairs flushed because this part completed a
          scope (with ``auto_flush``), else ``[]``.

        Raises:
          CollectorError: the part is rejected; the state is unchanged.
        """
        s, e, t, off, rows = self._check(part, self._rows)
        if isinstance(part, PolicyPart):
            self._state = _add_policy(self.plan, self._state, part)
        else:
            self._state = _add_env(self.plan, self._state, part)
        self._rows[type(part)][s, e, t, off : off + rows] = True
        return self._flush_complete([s])

    def add_many(self, parts: Iterable[PolicyPart | EnvPart]) -> list[tuple[str, Trajectory]]:
        """Insert many halves with one device call per group of like parts.

        All or nothing: every part is checked first; if one is rejected the error
        names it and none of the batch is inserted. Parts are grouped by kind and
        shape, stacked on the host, and inserted with ``add_policies`` /
        ``add_envs`` (each distinct group size compiles once).
        """
        parts = list(parts)
        scratch = {k: v.copy() for k, v in self._rows.items()}
        slots_of = []
        for part in parts:
            s, e, t, off, rows = self._check(part, scratch)
            scratch[type(part)][s, e, t, off : off + rows] = True
            slots_of.append(s)
        groups: dict[Any, list] = {}
        for part in parts:
            leaves, treedef = jax.tree.flatten(part)
            sig = (type(part), treedef, tuple(np.shape(x) for x in leaves))
            groups.setdefault(sig, []).append(part)
        for (kind, _, _), group in groups.items():
            stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *group)
            add = _add_policies if kind is PolicyPart else _add_envs
            self._state = add(self.plan, self._state, stacked)
        self._rows = scratch
        return self._flush_complete(sorted(set(slots_of)))

    def ready(self) -> list[tuple[int, int]]:
        """``(env_rank, stage_id)`` of the sources whose step is complete."""
        done = (self._rows[PolicyPart] & self._rows[EnvPart]).all(axis=(1, 2, 3))
        return [tuple(int(v) for v in self._sources[s]) for s in np.flatnonzero(done)]

    def flush(self, env_rank: int = 0, stage_id: int = 0) -> tuple[str, Trajectory]:
        """Flush one source's complete training step.

        Raises:
          CollectorError: the step is incomplete (nothing changes).
        """
        s = self._index(env_rank, stage_id)
        if (env_rank, stage_id) not in self.ready():
            missing = int((~(self._rows[PolicyPart][s] & self._rows[EnvPart][s])).sum())
            key = (self._step[s], -1, env_rank, stage_id, -1)
            raise CollectorError(key, ErrorCode.INCOMPLETE_SCOPE, f"{missing} row-slots missing")
        return self._flush_index(s)

    def _flush_index(self, s: int) -> tuple[str, Trajectory]:
        self._state, traj = _flush(self.plan, self._state, s)
        for mask in self._rows.values():
            mask[s] = False
        self._step[s] += 1
        return (self.plan.queue_key, traj)

    def _flush_complete(self, candidates: Iterable[int]) -> list[tuple[str, Trajectory]]:
        if not self.auto_flush:
            return []
        out = []
        for s in candidates:
            if (self._rows[PolicyPart][s] & self._rows[EnvPart][s]).all():
                out.append(self._flush_index(s))
        return out
