"""``TrajectoryCollector``: the thin host facade over the pure functions.

For service loops that are not jitted (host threads, actor processes). It checks every
half on the host before anything is written (:class:`jaxtraj.checks.HostChecks`,
against :class:`Mirror`, its numpy record of what arrived: a rejected part costs no
device sync and changes nothing), keeps the step's data in a storage
(:mod:`jaxtraj.storage`), and when a completion scope is complete asks its output mode
(:mod:`jaxtraj.modes`) to flush it, returning queue-ready ``(queue_key, item)`` pairs.
It never asks which mode it holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxtraj import checks, modes, state
from jaxtraj.errors import CollectorError, ErrorCode, waits_for
from jaxtraj.mirror import Mirror
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.storage import storage_for
from jaxtraj.types import EnvPart, PolicyPart, group_parts, stack_group, stack_parts

Items = list[tuple[str, Any]]

_STACK_AT_LEAST = 32  # small parts in one add_many call worth stacking (measured)
_SMALL_PART_BYTES = 64 << 10  # a part under this is small: stacking it costs less than
# checking it on its own


class TrajectoryCollector:
    """Holds the collector's state; accepts either half; flushes complete scopes.

    Example::

        collector = jaxtraj.TrajectoryCollector(plan, policy_example, env_example)
        for part in arrivals:                    # any order, any fragmentation
            for queue_key, item in collector.add(part):
                actor_queues[queue_key].put(item)

    What a scope and an item are is the output mode's (``plan.mode``): rollout, a
    source's step and its ``Trajectory`` on ``plan.queue_key``; pipeline, an epoch
    across every source and one ``MicroBatches`` per Actor rank on ``"actor_<r>"``;
    lerobot, a source's step and the episodes that ended, handed to the writer too.

    Args:
      plan: the static :class:`TrajectoryPlan`.
      policy_example: one example of a policy half; fixes the policy buffers'
        structure, trailing shapes and dtypes.
      env_example: one example of an env half; the same for the env buffers.
      sources: ``(env_rank, stage_id)`` pairs owned; default all of the plan's.
      step_id: the first training step.
      auto_flush: flush each scope as soon as it completes (``add`` returns the
        items); otherwise call :meth:`flush`.
      storage: ``"host"`` (numpy staging, one transfer per flush), ``"device"``
        (jitted inserts into device buffers: parts already on an accelerator), or
        ``"auto"``: device when the examples live on an accelerator, else host.
      mode_options: the output mode's own options: pipeline ``rng``, ``mesh``,
        ``source_axis``, ``actor_axis``; lerobot ``writer``, ``tasks``.
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
        storage: str = "auto",
        **mode_options: Any,
    ):
        self.plan, self.auto_flush = plan, auto_flush
        self.mode = modes.for_plan(plan, **mode_options)
        #: The policy version now training (pipeline mode masks older samples with it).
        self.current_version = 0
        sources = [tuple(int(v) for v in s) for s in (sources or plan.default_sources())]
        self.mirror = Mirror(plan, np.asarray(sources, np.int64).reshape(-1, 2), step_id)
        one = jax.eval_shape(lambda: state.init(plan, policy_example, env_example))
        self._checks = checks.HostChecks(plan, one, self.mirror.sources)
        self._store = storage_for(storage, plan, policy_example, env_example, self.mode,
                                  sources, step_id)
        self._mode_states = [self.mode.init(lay) for lay in self._store.layouts]
        # Per-action observations are retained in lerobot mode only (when the example has
        # them); elsewhere an env half's are dropped on arrival, as the pure add_env does.
        self._drop_action_obs = self._checks.layout.env.action_obs is None
        # The policy outputs the buffers hold: a half without one of them is an expert's.
        out = self._checks.layout.policy.output
        self._outputs = tuple(f for f in out.__dataclass_fields__ if getattr(out, f) is not None)

    # -- what it holds --------------------------------------------------------------------

    @property
    def sources(self) -> list[tuple[int, int]]:
        """The ``(env_rank, stage_id)`` pairs this collector owns, in source-index order."""
        return [tuple(int(v) for v in s) for s in self.mirror.sources]

    @property
    def state(self) -> state.CollectorState:
        """Every source's state as one stacked host copy (for inspection)."""
        return self.mode.join(list(self.states))

    @property
    def states(self) -> tuple[state.CollectorState, ...]:
        """The states as stored: one per source, or one stacked (pipeline mode); views of
        the numpy staging buffers (host storage) or the device arrays (device storage).
        Live: later collection changes (or, on device, donates) them; take
        :meth:`state_dict` for a snapshot."""
        return tuple(self._store.state(i, self.mirror) for i in range(len(self._store.groups)))

    @property
    def mode_states(self) -> tuple[Any, ...]:
        """The output mode's state per state (pipeline: key and flushed epochs; lerobot:
        running episodes; rollout: ``None``)."""
        return tuple(self._mode_states)

    @property
    def layout(self) -> state.CollectorState:
        """One source's buffers as shapes and dtypes (``jax.ShapeDtypeStruct`` leaves)."""
        return self._checks.layout

    def check_structure(self, part: PolicyPart | EnvPart) -> checks.Layout:
        """Check a half's structure, shapes and dtypes against the plan's examples, from
        any thread (e.g. a producer's, before it publishes the half).

        Raises:
          CollectorError: ``STRUCTURE_MISMATCH`` naming the field.
        """
        key = part.source.key.as_tuple() if hasattr(part, "source") else None
        return self._checks.structure(self._admit(part), False, key)

    def _admit(self, part: Any, stacked: bool = False) -> Any:
        """The part as the buffers hold it: per-action observations dropped where they
        are not retained; an expert's policy half (no log-probabilities, values, ...)
        zero-filled in lerobot mode, refused in the others (``STRUCTURE_MISMATCH``)."""
        kind = type(part)
        if kind is EnvPart:
            if self._drop_action_obs and part.action_obs is not None:
                return part.replace(action_obs=None)
        elif kind is PolicyPart:
            out = part.output
            for name in self._outputs:
                if getattr(out, name) is None:
                    key = None if stacked else part.source.key.as_tuple()
                    lay = self._checks.layout
                    return checks.expert_half(self.plan, lay, part, np, key, stacked)
        return part

    def current_step(self, env_rank: int = 0, stage_id: int = 0) -> int:
        """The training step a source currently accepts."""
        return int(self.mirror.step[self._source(env_rank, stage_id)])

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Everything this collector holds, as one pytree of arrays (for checkpoints):
        the states (partial slots and fragments included), the mirror, the mode's state.
        Restore it with :meth:`load_state_dict` on a collector built alike.

        Args:
          copy: a snapshot that later collection never changes (the default; safe to
            hand to an asynchronous checkpointer). ``False`` returns views of the live
            buffers, valid only until the next insert: for a writer that saves them at
            once (:func:`jaxtraj.checkpoint.save` does).
        """
        out = {
            "states": list(self.states),
            "mode": jax.tree.map(np.asarray, list(self._mode_states)),
            "mirror": self.mirror.state_dict(),
            "current_version": np.asarray(self.current_version, np.int64),
        }
        return jax.tree.map(lambda x: x.copy(), out) if copy else out

    def load_state_dict(self, tree: dict[str, Any]) -> None:
        """Replace everything this collector holds with ``tree`` (from :meth:`state_dict`)."""
        self.mirror.load_state_dict(tree["mirror"])
        self.current_version = int(tree["current_version"])
        for i, st in enumerate(tree["states"]):
            self._store.load(i, st)
        self._mode_states = [jax.device_put(x) for x in tree["mode"]]
        self.mode.restored(self._mode_states)

    # -- inserts --------------------------------------------------------------------------

    def _source(self, env_rank: int, stage_id: int) -> int:
        s = self.mirror.index.get((int(env_rank), int(stage_id)))
        if s is None:
            raise CollectorError(None, ErrorCode.UNKNOWN_SOURCE, f"({env_rank}, {stage_id})")
        return s

    def add(self, part: PolicyPart | EnvPart) -> Items:
        """Insert one half (or fragment); return the items of the scopes it completed.

        Raises:
          CollectorError: the part is rejected; nothing changes.
        """
        m = self.mirror
        part = self._admit(part)
        try:
            s, e, t, off, layout, leaves, treedef = self._checks.one(
                part, m.rows.get(type(part)), m.step
            )
        except CollectorError as err:
            resend = err.code == ErrorCode.DUPLICATE and self.plan.resend == "accept_identical"
            if resend and self._store.resent(self.mirror, self.mode, part):
                return []  # a restarted worker's re-send of what we have: accepted once
            raise
        i, at = self.mode.slot(s, e, t, off)
        self._store.insert(i, at, leaves, treedef, layout)
        m.mark(type(part), s, e, t, off, layout.rows)
        m.last_seen[s] = time.monotonic()
        if m.received[s, e] < m.full:  # nothing new can be complete
            return []
        return self._flush_complete()

    def add_many(self, parts: Iterable[PolicyPart | EnvPart] | PolicyPart | EnvPart) -> Items:
        """Insert many halves: a sequence of parts, or one stacked part (a leading axis
        ``N`` on every leaf, keys included), e.g. built by a service loop.

        All or nothing: every part is checked first (rows repeated within the batch are
        duplicates too); if one is rejected the error names it and none of the batch is
        inserted.
        """
        if isinstance(parts, (PolicyPart, EnvPart)):
            return self._add_stacked([self._admit(parts, stacked=True)])
        parts = [self._admit(p) for p in parts]
        if not parts:
            return []
        if not self._store.owned:  # device storage: one jitted insert per group
            return self._add_stacked(stack_parts(parts))
        # Many small parts are stacked (a second copy of a few KiB costs less than checking
        # each on its own; the stacked checks cost ~0.3 ms a group, so only for many);
        # large ones are checked and copied one by one (no second copy). Parts of one group
        # share shapes and dtypes, so one part's size is the group's.
        groups = group_parts(parts)
        small = [g.nbytes < _SMALL_PART_BYTES for g, _ in groups]
        if sum(len(places) for (_, places), sm in zip(groups, small) if sm) < _STACK_AT_LEAST:
            small = [False] * len(groups)
        large = sorted(n for (_, places), sm in zip(groups, small) if not sm for n in places)
        stacked = [(stack_group(g), places) for (g, places), sm in zip(groups, small) if sm]
        return self._add_stacked(
            [g for g, _ in stacked], [parts[n] for n in large], large, [p for _, p in stacked]
        )

    def _add_stacked(
        self, groups: list, large: list = (), places: list | None = None,
        group_places: list | None = None,
    ) -> Items:
        """Check ``groups`` (stacked parts; ``group_places`` their parts' places in the
        caller's batch) and ``large`` (parts one by one, at ``places``) against one copy
        of the coverage, then insert them all."""
        rows = {k: v.copy() for k, v in self.mirror.rows.items()}
        checked = self._checks.many(large, rows, self.mirror.step, places) if large else []
        stacked = [
            self._checks.stack(g, rows[type(g)], self.mirror.step,
                               None if group_places is None else group_places[n])
            for n, g in enumerate(groups)
        ]
        owners, layouts = [s for s, _ in stacked], [lay for _, lay in stacked]
        for s, e, t, off, layout, leaves, treedef in checked:
            self._store.insert(*self.mode.slot(s, e, t, off), leaves, treedef, layout)
        for group, s_of, layout in zip(groups, owners, layouts):
            self._store.insert_stack(self.mode, group, s_of, layout)
        # Everything is in: record it (rows received per source and epoch, per part).
        per_part = [np.array([(c[0], c[1], c[4].rows) for c in checked], np.int64).reshape(-1, 3)]
        for group, s_of, layout in zip(groups, owners, layouts):
            e = np.broadcast_to(np.asarray(group.source.key.epoch_id, np.int64), s_of.shape)
            per_part.append(np.stack([s_of, e, np.full(s_of.shape, layout.rows)], axis=1))
        s, e, n = np.concatenate(per_part).T
        self.mirror.take(rows, s, e, n)
        self.mirror.last_seen[s] = time.monotonic()
        return self._flush_complete()

    # -- scopes and flushes ---------------------------------------------------------------

    def ready(self) -> list[Any]:
        """The complete scopes, by name: ``(env_rank, stage_id)`` sources (rollout,
        lerobot) or epochs (pipeline)."""
        return [self.mode.scope_name(c, self.mirror) for c in self.mode.scopes(self.mirror)]

    def flush(self, *scope: Any) -> Items:
        """Flush one complete scope, named as :meth:`ready` names it (a source as
        ``flush(env_rank, stage_id)``, an epoch as ``flush(epoch)``; default the first).

        Raises:
          CollectorError: ``INCOMPLETE_SCOPE``, the scope is incomplete or was flushed
            (nothing changes).
        """
        complete = self.mode.scopes(self.mirror)
        name = scope[0] if len(scope) == 1 else tuple(scope)
        c = self.mode.scope_index(name, self.mirror) if scope else (complete or [None])[0]
        if c is None or c not in complete:
            if not scope:  # no scope named and none complete: name the first one
                key = self.mode.describe(0, self.mirror)
                detail = f"flush() of the first scope: none is complete; it {self._waiting_for(key)}"
            else:
                key = self.mode.describe(c, self.mirror) if c is not None else None
                detail = f"scope {name!r}: {self._waiting_for(key)}"
            raise CollectorError(key, ErrorCode.INCOMPLETE_SCOPE, detail)
        return self._flush(c)

    def _waiting_for(self, key: tuple | None, shown: int = 3) -> str:
        """What the scope ``key`` describes (``-1``: any) still waits for, cut short."""
        left = [
            m for m in self.missing()
            if key is None or all(k < 0 or v == k for v, k in zip(m[0][1:4], key[1:4]))
        ]
        return waits_for(left, shown)

    def _flush(self, c: int) -> Items:
        i = self.mode.state_index(c)
        device_state = self._store.device_state(i, self.mirror)
        items, new, mode_state = self.mode.compiled_flush(
            device_state, self._mode_states[i], c, self.current_version, owned=self._store.owned
        )
        out = self.mode.emit(items, c, self.mirror)  # may raise: nothing has changed yet
        self._mode_states[i] = mode_state
        self._store.after_flush(i, new)
        for j in self.mode.advance(c, self.mirror):
            self._store.renew(j)
        self.mirror.last_seen[self._store.groups[i]] = time.monotonic()  # the next step starts
        return out

    def _flush_complete(self) -> Items:
        if not self.auto_flush:
            return []
        return [item for c in self.mode.scopes(self.mirror) for item in self._flush(c)]

    # -- faults ---------------------------------------------------------------------------

    def end(self) -> Items:
        """End collection: hand over what the output mode still holds between scopes.

        Lerobot mode writes every running episode (to the writer, and returns them as
        ``flush`` items do), its last frame marked done and truncated: the recording
        ended it, not the environment. Call it after the last training step's flush,
        before closing the writer. Rollout and pipeline modes hold nothing between
        scopes: ``[]``.

        Raises:
          CollectorError: ``INCOMPLETE_SCOPE`` while a training step has halves collected
            but is not complete (its frames would be lost); nothing is written. Complete
            it (``missing()`` says what it waits for), then call again.
        """
        complete = self.ready()
        if complete:  # auto_flush=False, or an auto-flush that failed: they wait for flush()
            why = ("auto_flush=False" if not self.auto_flush else
                   "their auto-flush failed: the error it raised says why")
            raise CollectorError(
                None,
                ErrorCode.INCOMPLETE_SCOPE,
                f"scopes {complete} are complete but not flushed ({why}): "
                "flush() them before end()",
            )
        m = self.mirror  # halves received in epochs not flushed yet: they would be lost
        unflushed = (m.received > 0) & ~m.flushed[None, :]
        partial = [self.sources[s] for s in np.flatnonzero(unflushed.any(axis=1))]
        if partial:
            raise CollectorError(
                None,
                ErrorCode.INCOMPLETE_SCOPE,
                f"sources {partial} have a training step half collected: "
                f"{self._waiting_for(None)}",
            )
        out: Items = []
        for i, mode_state in enumerate(self._mode_states):
            items, self._mode_states[i] = self.mode.end(mode_state, i)
            out += items
        return out

    def missing(self) -> list[tuple[tuple[int, ...], str, int]]:
        """What the current step still waits for: ``(key, half, rows missing)`` per slot."""
        return self.mirror.missing()

    def check_stalled(self, timeout_s: float, now: float | None = None) -> None:
        """Raise if a source has parts missing and sent nothing for ``timeout_s`` seconds.

        Call it from the service loop. The other sources' data is untouched and still
        flushes; the stalled source's parts can still arrive after the error.

        Raises:
          CollectorError: ``SOURCE_TIMEOUT``, naming the stalled source and its
            missing keys.
        """
        self.mirror.check_stalled(timeout_s, time.monotonic() if now is None else now)
