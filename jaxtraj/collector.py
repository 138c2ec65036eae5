"""``TrajectoryCollector``: the thin host facade over the pure functions.

For service loops that are not jitted (host threads, actor processes): it holds one
single-source state per source, checks every half on the host before it reaches the
device (a numpy mirror of the coverage masks: rejecting a part costs no device sync
and changes nothing), raises :class:`jaxtraj.CollectorError` naming the key and the
reason, and returns queue-ready ``(queue_key, item)`` pairs when a scope completes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxtraj import episodes as ep_lib
from jaxtraj import joiner, lerobot, pipeline, rollout, slots
from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import EnvPart, PolicyPart, Trajectory, TrajectoryKey, TrajectorySource, rows_of

_jit = functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
_ADD = {PolicyPart: _jit(joiner.add_policy), EnvPart: _jit(joiner.add_env)}
_ADD_MANY = {PolicyPart: _jit(joiner.add_policies), EnvPart: _jit(joiner.add_envs)}


def _flush_in_place(plan: TrajectoryPlan, state: joiner.CollectorState):
    """Rollout flush that hands the state's buffers to the trajectory without a copy.

    ``jit`` matches donated buffers to outputs in output order, so the trajectory goes
    first: its fields alias the donated buffers and the state gets the fresh ones.
    """
    state, traj = rollout.flush(plan, state, assume_complete=True)
    return traj, state


_flush = _jit(_flush_in_place)
# Not donated: if an episode overflows, the old state and episodes are kept as they were.
_lerobot_flush = jax.jit(lerobot.flush, static_argnums=0)


def _per_part_any(x: Any, n: int) -> np.ndarray:
    if x is None:
        return np.zeros((n,), bool)
    return np.asarray(x).reshape(n, -1).any(axis=1)


def stack_parts(parts: Iterable[PolicyPart | EnvPart]) -> list[PolicyPart | EnvPart]:
    """Group parts by kind, structure and shape, and stack each group on the host.

    Returns one stacked part per group (a leading axis on every leaf, keys
    included), in order of first appearance: what :meth:`TrajectoryCollector.add_many`
    and the pure ``add_policies`` / ``add_envs`` take.
    """
    by_sig: dict[Any, list] = {}
    for part in parts:
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise CollectorError(None, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
        leaves, treedef = jax.tree.flatten(part)
        sig = (treedef, tuple([getattr(x, "shape", ()) for x in leaves]))  # hot: no np.shape
        by_sig.setdefault(sig, []).append(leaves)
    return [
        jax.tree.unflatten(treedef, [np.stack(xs) for xs in zip(*group)])
        for (treedef, _), group in by_sig.items()
    ]


class TrajectoryCollector:
    """Holds the collector's state; accepts either half; flushes complete scopes.

    Example::

        collector = jaxtraj.TrajectoryCollector(plan, policy_example, env_example)
        for part in arrivals:                    # any order, any fragmentation
            for queue_key, trajectory in collector.add(part):
                actor_queues[queue_key].put(trajectory)

    In rollout mode each complete source step flushes one ``Trajectory`` on
    ``plan.queue_key``. In pipeline mode each complete epoch (across every source)
    flushes :class:`jaxtraj.MicroBatches`, one item per Actor rank on the queue keys
    ``"actor_0"``, ``"actor_1"``, ... In lerobot mode each complete source step
    appends to the running episodes and flushes the episodes that ended, as a list of
    ``(env_index, frames)`` (frames: dict of host arrays ``[length, ...]``), and hands
    them to ``writer.add_episodes`` when a writer is given.

    Args:
      plan: the static :class:`TrajectoryPlan`; its ``mode`` picks the output.
      policy_example, env_example: one example of each half; fixes the buffers'
        structure, trailing shapes and dtypes.
      sources: ``(env_rank, stage_id)`` pairs owned; default all of the plan's.
      step_id: the first training step.
      auto_flush: flush each scope as soon as it completes (``add`` returns the
        items); otherwise call :meth:`flush` / :meth:`flush_epoch`.
      rng: pipeline mode's PRNG key; epoch ``e`` of step ``k`` is shuffled with
        ``fold_in(fold_in(rng, k), e)``, whatever the arrival order.
      mesh, source_axis, actor_axis: pipeline mode on several devices: sources
        sharded over ``source_axis``, micro-batches over ``actor_axis``. With
        several processes (``jax.distributed``), give each process its own
        ``sources``, a mesh over all processes' devices, ``auto_flush=False``, and
        call :meth:`flush_epoch` on every process in the same order.
      writer: lerobot mode: an object with ``add_episodes(episodes, tasks)``, e.g. a
        ``jaxtraj.lerobot_writer.LeRobotWriter``.
      tasks: lerobot mode: the task string of every environment (one string for all,
        or one per environment index).
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
        rng: jax.Array | None = None,
        mesh: jax.sharding.Mesh | None = None,
        source_axis: str = "sources",
        actor_axis: str = "actor",
        writer: Any = None,
        tasks: str | Sequence[str] | None = None,
    ):
        self.plan = plan
        self.auto_flush = auto_flush
        sources = [tuple(int(v) for v in s) for s in (sources or plan.default_sources())]
        self._pipeline = plan.mode == "pipeline"
        if self._pipeline:  # one stacked state: the flush spans every source
            state = joiner.init(plan, policy_example, env_example, sources=sources, step_id=step_id)
            # Several processes (jax.distributed): this process's sources stay local and
            # form a global state only inside the flush.
            self._multihost = mesh is not None and jax.process_count() > 1
            self._mesh, self._source_axis = mesh, source_axis
            if mesh is not None and not self._multihost:
                state = pipeline.shard_state(state, mesh, source_axis)
            self._states = [state]
            self._pipeline_flush = pipeline.make_flush(
                plan, mesh, source_axis=source_axis, actor_axis=actor_axis
            )
            self._rng = jax.random.PRNGKey(0) if rng is None else rng
            self._flushed = np.zeros((plan.num_epochs,), bool)
            # The policy version now training: set it as the policy updates, so that
            # plan.max_staleness can mask older samples.
            self.current_version = 0
        else:  # one state per source: each flushes on its own, without a copy
            self._states = [
                joiner.init(plan, policy_example, env_example, sources=s, step_id=step_id)
                for s in sources
            ]
        if plan.mode == "lerobot":
            self._episodes = [lerobot.init_episodes(plan, st) for st in self._states]
            self._writer = writer
            tasks = tasks if tasks is not None else "default"
            self._tasks = [tasks] * plan.batch_size if isinstance(tasks, str) else list(tasks)
            if len(self._tasks) != plan.batch_size or not all(self._tasks):
                raise ValueError(
                    f"tasks must be one non-empty string or {plan.batch_size} of them, got {tasks!r}"
                )
        self._sources = np.asarray(sources, np.int64).reshape(-1, 2)
        self._source_index = {src: i for i, src in enumerate(sources)}
        shape = (len(sources), plan.num_epochs, plan.num_chunks, plan.batch_size)
        self._rows = {PolicyPart: np.zeros(shape, bool), EnvPart: np.zeros(shape, bool)}
        self._step = np.full((len(sources),), step_id, np.int64)
        self._needs_final = self._states[0].policy.output.prev_values is not None
        self._last_seen = np.full((len(sources),), time.monotonic())
        self._layout = (
            jax.tree.map(lambda x: x[0], self._states[0]) if self._pipeline else self._states[0]
        )
        self._checked: dict[Any, tuple] = {}  # part signature -> (rows, boundary flags)

    @property
    def state(self) -> joiner.CollectorState:
        """The state as one stacked host copy (for inspection and checkpoints)."""
        if self._pipeline:
            return jax.tree.map(np.asarray, self._states[0])
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *self._states)

    @property
    def states(self) -> tuple[joiner.CollectorState, ...]:
        """The device states: one per source (rollout) or one stacked (pipeline)."""
        return tuple(self._states)

    def _state_index(self, s: int) -> int:
        return 0 if self._pipeline else s

    def current_step(self, env_rank: int = 0, stage_id: int = 0) -> int:
        """The training step a source currently accepts."""
        return int(self._step[self._index(env_rank, stage_id)])

    def _index(self, env_rank: int, stage_id: int) -> int:
        found, s = slots.locate(np, self._sources, env_rank, stage_id)
        if not found:
            raise CollectorError(None, ErrorCode.UNKNOWN_SOURCE, f"({env_rank}, {stage_id})")
        return int(s)

    # -- host-side checks -------------------------------------------------------------

    def _structure(self, part: Any, stacked: bool, key: Any) -> tuple:
        """Structure check, cached by signature: ``(rows, has_initial, has_final, has_next)``."""
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise CollectorError(key, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
        leaves, treedef = jax.tree.flatten(part.replace(source=None))
        sig = (treedef, tuple((np.shape(x), getattr(x, "dtype", None)) for x in leaves), stacked)
        if sig not in self._checked:
            view = part
            if stacked:  # check one element of the stack
                view = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], np.asarray(x).dtype), part
                )
            if isinstance(part, PolicyPart):
                rows = joiner.policy_structure(self._layout, view, key)
                flags = (rows, False, False, False, False)
            else:
                flags = joiner.env_structure(self._layout, view, key)
            self._checked[sig] = flags
        return self._checked[sig]

    def _check_one(self, part: Any) -> tuple[int, int, int, int, int]:
        """Check one part against the mirror with plain Python scalars.

        Returns its ``(s, epoch, chunk, offset, rows)``; raises ``CollectorError``.
        """
        if not isinstance(part, (PolicyPart, EnvPart)):
            raise CollectorError(None, ErrorCode.STRUCTURE_MISMATCH, f"not a part: {type(part)}")
        key = part.source.key.as_tuple()
        bs, off = int(np.asarray(part.source.batch_size)), int(np.asarray(part.source.offset))
        rows, has_initial, has_final, has_next, has_rlt = self._structure(part, False, key)
        s = self._source_index.get((key[2], key[3]))
        found, s = s is not None, s or 0
        src = TrajectorySource(TrajectoryKey(*key), bs, off)
        checks = slots.key_checks(slots.py, self.plan, src, rows, found, int(self._step[s]))
        e, t = key[1], key[4]
        if not slots.first_error(slots.py, checks):
            dup = bool(self._rows[type(part)][s, e, t, off : off + rows].any())
            checks.append((dup, ErrorCode.DUPLICATE))
        if isinstance(part, EnvPart):
            checks += slots.env_checks(
                slots.py,
                self.plan,
                t,
                has_initial=has_initial,
                has_final=has_final,
                has_next_obs=has_next or not self.plan.collect_transitions,
                has_next_rlt=has_rlt or not self.plan.enable_rlt,
                needs_final=self._needs_final,
                cut=bool(np.any(slots.cut_flags(self.plan, part))),
            )
        if self.plan.nonfinite == "reject":
            finite = all(np.isfinite(np.asarray(x)).all() for x in slots.finite_leaves(part))
            checks.append((not finite, ErrorCode.NON_FINITE))
        code = slots.first_error(slots.py, checks)
        if code:
            raise CollectorError(key, code)
        return s, e, t, off, rows

    def _check_stack(self, part: Any, mirror: dict) -> np.ndarray:
        """Check a stack of parts against ``mirror``; update it; return their sources.

        Raises ``CollectorError`` for the first rejected part; ``mirror`` is then
        unchanged.
        """
        keys = np.stack([np.asarray(v, np.int64) for v in part.source.key.fields()], axis=1)
        bs = np.asarray(part.source.batch_size, np.int64)
        off = np.asarray(part.source.offset, np.int64)
        rows, has_initial, has_final, has_next, has_rlt = self._structure(part, True, keys[0])
        n = keys.shape[0]
        bs, off = np.broadcast_to(bs, (n,)), np.broadcast_to(off, (n,))
        match = (self._sources[None, :, 0] == keys[:, 2:3]) & (
            self._sources[None, :, 1] == keys[:, 3:4]
        )
        found, s = match.any(axis=1), match.argmax(axis=1)
        src = TrajectorySource(TrajectoryKey(*keys.T), bs, off)
        checks = slots.key_checks(np, self.plan, src, rows, found, self._step[s])
        valid = slots.first_error(np, checks) == 0
        e, t = np.where(valid, keys[:, 1], 0), np.where(valid, keys[:, 4], 0)
        o = np.where(valid, off, 0)
        row_idx = o[:, None] + np.arange(rows)
        mask = mirror[type(part)]
        dup = mask[s[:, None], e[:, None], t[:, None], row_idx].any(axis=1)
        # Rows repeated within the batch: every occurrence after the first is a duplicate.
        flat = np.ravel_multi_index((s[:, None], e[:, None], t[:, None], row_idx), mask.shape)
        flat = np.where(valid[:, None], flat, -1 - np.arange(n)[:, None])
        _, first = np.unique(flat.ravel(), return_index=True)
        seen_first = np.zeros(flat.size, bool)
        seen_first[first] = True
        dup |= ~seen_first.reshape(flat.shape).all(axis=1)
        checks.append((dup, ErrorCode.DUPLICATE))
        if isinstance(part, EnvPart):
            checks += slots.env_checks(
                np,
                self.plan,
                keys[:, 4],
                has_initial=has_initial,
                has_final=has_final,
                has_next_obs=has_next or not self.plan.collect_transitions,
                has_next_rlt=has_rlt or not self.plan.enable_rlt,
                needs_final=self._needs_final,
                cut=_per_part_any(slots.cut_flags(self.plan, part), n),
            )
        if self.plan.nonfinite == "reject":
            finite = np.ones((n,), bool)
            for x in slots.finite_leaves(part):
                finite &= np.isfinite(np.asarray(x)).reshape(n, -1).all(axis=1)
            checks.append((~finite, ErrorCode.NON_FINITE))
        code = slots.first_error(np, checks)
        bad = np.flatnonzero(code)
        if bad.size:
            i = bad[0]
            raise CollectorError(keys[i], code[i], f"part {i} of its group in the batch")
        mask[s[:, None], e[:, None], t[:, None], row_idx] = True
        return s

    # -- inserts and flushes ------------------------------------------------------------

    def add(self, part: PolicyPart | EnvPart) -> list[tuple[str, Trajectory]]:
        """Insert one half (or fragment).

        Returns:
          ``(queue_key, Trajectory)`` pairs flushed because this part completed a
          scope (with ``auto_flush``), else ``[]``.

        Raises:
          CollectorError: the part is rejected; nothing changes.
        """
        try:
            s, e, t, off, rows = self._check_one(part)
        except CollectorError as err:
            if err.code == ErrorCode.DUPLICATE and self._identical_resend(part):
                return []  # a restarted worker's re-send of what we have: accepted once, a no-op
            raise
        i = self._state_index(s)
        self._states[i] = _ADD[type(part)](self.plan, self._states[i], part)
        self._rows[type(part)][s, e, t, off : off + rows] = True
        self._last_seen[s] = time.monotonic()
        return self._flush_complete([s])

    def _identical_resend(self, part: Any) -> bool:
        """With ``plan.resend == "accept_identical"``: whether every row of ``part`` was
        received already, with exactly this data (one device-to-host read of those rows)."""
        if self.plan.resend != "accept_identical":
            return False
        key = part.source.key.as_tuple()
        s = self._source_index[(key[2], key[3])]
        e, t, off = key[1], key[4], int(np.asarray(part.source.offset))
        rows = rows_of(part.replace(source=None))
        if not self._rows[type(part)][s, e, t, off : off + rows].all():
            return False  # a partial overlap is not a re-send
        state = self._states[self._state_index(s)]
        at = (s, e, t) if state.stacked else (e, t)
        if isinstance(part, PolicyPart):
            sent, kept = part.replace(source=None), state.policy
        else:
            fields = dict(source=None, initial_transition=None, next_obs=None, next_rlt_obs=None)
            sent = part.replace(**fields, final_values=None)
            kept = state.env.replace(**fields, final_values=None)
            if part.final_values is not None:
                sent, kept = (sent, part.final_values), (kept, state.env.final_values)
        stored = jax.tree.map(lambda b: np.asarray(b[at][off : off + rows]), kept)
        same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), sent, stored)
        return all(jax.tree.leaves(same))

    def missing(self) -> list[tuple[tuple[int, ...], str, int]]:
        """What the current step still waits for: ``(key, half, rows missing)`` per slot."""
        out = []
        for kind, name in ((PolicyPart, "policy"), (EnvPart, "env")):
            rows = self._rows[kind]
            for s, e, t in zip(*np.nonzero(~rows.all(axis=-1))):
                if self._pipeline and self._flushed[e]:
                    continue
                r, st = (int(v) for v in self._sources[s])
                key = (int(self._step[s]), int(e), r, st, int(t))
                out.append((key, name, int((~rows[s, e, t]).sum())))
        return sorted(out)

    def check_stalled(self, timeout_s: float, now: float | None = None) -> None:
        """Raise if a source has parts missing and sent nothing for ``timeout_s`` seconds.

        Call it from the service loop. The other sources' data is untouched and still
        flushes; the stalled source's parts can still arrive after the error.

        Raises:
          CollectorError: ``SOURCE_TIMEOUT``, naming the stalled source and its
            missing keys.
        """
        now = time.monotonic() if now is None else now
        missing = self.missing()
        waiting = {(k[2], k[3]) for k, _, _ in missing}
        for s in np.argsort(self._last_seen, kind="stable"):  # the longest silent first
            r, st = (int(v) for v in self._sources[s])
            if (r, st) in waiting and now - self._last_seen[s] > timeout_s:
                keys = [k for k, _, _ in missing if (k[2], k[3]) == (r, st)]
                shown = ", ".join(str(k) for k in keys[:8]) + (" ..." if len(keys) > 8 else "")
                raise CollectorError(
                    (int(self._step[s]), -1, r, st, -1),
                    ErrorCode.SOURCE_TIMEOUT,
                    f"{len(keys)} halves missing after {timeout_s} s: {shown}",
                )

    def add_many(self, parts: Iterable[PolicyPart | EnvPart] | PolicyPart | EnvPart):
        """Insert many halves with one device call per source and group of like parts.

        Args:
          parts: a sequence of parts, or one stacked part (a leading axis ``N`` on
            every leaf, keys included), e.g. built by a service loop.

        All or nothing: every part is checked first; if one is rejected the error
        names it and none of the batch is inserted. A sequence is grouped by kind and
        shape and stacked on the host; each distinct group size compiles once.

        Returns:
          The ``(queue_key, Trajectory)`` pairs flushed.
        """
        if isinstance(parts, (PolicyPart, EnvPart)):
            groups = [parts]
        else:
            groups = stack_parts(parts)
        mirror = {k: v.copy() for k, v in self._rows.items()}
        owners = [self._check_stack(group, mirror) for group in groups]
        touched = set()
        for group, s_of in zip(groups, owners):
            touched.update(int(s) for s in np.unique(s_of))
            if self._pipeline:
                self._states[0] = _ADD_MANY[type(group)](self.plan, self._states[0], group)
                continue
            for s in np.unique(s_of):
                sub = group
                if len(np.unique(s_of)) > 1:
                    sub = jax.tree.map(lambda x, s=s: np.asarray(x)[s_of == s], group)
                self._states[s] = _ADD_MANY[type(group)](self.plan, self._states[s], sub)
        self._rows = mirror
        self._last_seen[sorted(touched)] = time.monotonic()
        return self._flush_complete(sorted(touched))

    def ready(self) -> list[tuple[int, int]]:
        """``(env_rank, stage_id)`` of the sources whose step is complete."""
        done = (self._rows[PolicyPart] & self._rows[EnvPart]).all(axis=(1, 2, 3))
        return [tuple(int(v) for v in self._sources[s]) for s in np.flatnonzero(done)]

    def flush(self, env_rank: int = 0, stage_id: int = 0) -> tuple[str, Trajectory]:
        """Flush one source's complete training step (rollout mode).

        Raises:
          CollectorError: the step is incomplete (nothing changes).
        """
        if self._pipeline:
            raise ValueError("pipeline mode flushes epochs: use flush_epoch(epoch)")
        # rollout: (queue_key, Trajectory); lerobot: (queue_key, completed episodes)
        s = self._index(env_rank, stage_id)
        if (env_rank, stage_id) not in self.ready():
            missing = int((~(self._rows[PolicyPart][s] & self._rows[EnvPart][s])).sum())
            key = (self._step[s], -1, env_rank, stage_id, -1)
            raise CollectorError(key, ErrorCode.INCOMPLETE_SCOPE, f"{missing} row-slots missing")
        return self._flush_index(s)

    def _flush_index(self, s: int) -> tuple[str, Any]:
        self._last_seen[s] = time.monotonic()  # the next step starts now
        if self.plan.mode == "lerobot":
            return self._flush_episodes(s)
        traj, self._states[s] = _flush(self.plan, self._states[s])
        for mask in self._rows.values():
            mask[s] = False
        self._step[s] += 1
        return (self.plan.queue_key, traj)

    def _flush_episodes(self, s: int) -> tuple[str, list]:
        state, episodes, batch = _lerobot_flush(self.plan, self._states[s], self._episodes[s])
        overflow = np.asarray(batch.overflow)
        if overflow.any():
            key = (self._step[s], -1, *self._sources[s], -1)
            envs = np.flatnonzero(overflow).tolist()
            raise CollectorError(key, ErrorCode.EPISODE_OVERFLOW, f"environments {envs}")
        self._states[s], self._episodes[s] = state, episodes
        for mask in self._rows.values():
            mask[s] = False
        self._step[s] += 1
        done = [
            (b, frames) for b, eps in enumerate(ep_lib.completed_episodes(batch)) for frames in eps
        ]
        if self._writer is not None and done:
            self._writer.add_episodes([f for _, f in done], [self._tasks[b] for b, _ in done])
        return (self.plan.queue_key, done)

    def episodes_in_progress(self, env_rank: int = 0, stage_id: int = 0) -> np.ndarray:
        """Lerobot mode: frames each environment's running episode holds, ``[B]``."""
        return np.asarray(self._episodes[self._index(env_rank, stage_id)].length)

    def epochs_ready(self) -> list[int]:
        """Pipeline mode: epochs complete across every source and not yet flushed."""
        both = self._rows[PolicyPart] & self._rows[EnvPart]
        done = both.all(axis=(0, 2, 3)) & ~self._flushed
        return [int(e) for e in np.flatnonzero(done)]

    def flush_epoch(self, epoch: int) -> list[tuple[str, pipeline.MicroBatches]]:
        """Pipeline mode: flush a complete epoch as one item per Actor rank.

        Returns:
          ``[("actor_0", micro_batches_0), ...]``; each item's leaves are
          ``[micro_batches, micro_batch_size, ...]``.

        Raises:
          CollectorError: the epoch is incomplete or already flushed (nothing changes).
        """
        if not self._pipeline:
            raise ValueError("rollout mode flushes sources: use flush(env_rank, stage_id)")
        if epoch not in self.epochs_ready():
            key = (int(self._step[0]), epoch, -1, -1, -1)
            raise CollectorError(
                key, ErrorCode.INCOMPLETE_SCOPE, "epoch incomplete or already flushed"
            )
        # The shuffle key depends on (step, epoch) only, not on which epoch completed first.
        sub = jax.random.fold_in(jax.random.fold_in(self._rng, int(self._step[0])), epoch)
        state = self._states[0]
        if self._multihost:
            state = pipeline.global_state(state, self._mesh, self._source_axis)
        state, batches = self._pipeline_flush(state, epoch, sub, self.current_version)
        self._states[0] = pipeline.local_state(state) if self._multihost else state
        self._flushed[epoch] = True
        if self._flushed.all():
            self._flushed[:] = False
            for mask in self._rows.values():
                mask[:] = False
            self._step += 1
        if self._multihost:  # the global micro-batches: each process reads its shards
            return [("actor", batches)]
        R = self.plan.actor_ranks
        return [(f"actor_{r}", jax.tree.map(lambda x, r=r: x[r], batches)) for r in range(R)]

    def _flush_complete(self, candidates: Iterable[int]) -> list[tuple[str, Trajectory]]:
        if not self.auto_flush:
            return []
        if self._pipeline:
            return [item for e in self.epochs_ready() for item in self.flush_epoch(e)]
        out = []
        for s in candidates:
            if (self._rows[PolicyPart][s] & self._rows[EnvPart][s]).all():
                out.append(self._flush_index(s))
        return out
