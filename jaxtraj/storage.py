"""Where the facade keeps a step's data until its scope flushes (internal).

Two strategies with one small interface, chosen by :class:`jaxtraj.TrajectoryCollector`:

- :class:`HostStorage` (numpy parts): every half is copied once, by ``np.copyto``, into
  host staging buffers allocated 64-byte aligned; a flush hands them to the device in
  one transfer per buffer. On the CPU backend that transfer is zero-copy (JAX adopts
  aligned host memory), so a half costs one pass over its bytes and a flush none. A
  step's staging is never written while anything else holds it: the next step's
  first half takes the buffers of an earlier step that nobody references any more
  (its trajectory was dropped: no page faults, no allocation; the latest such, whose
  memory is warmest), or fresh ones; once the caller has dropped the latest step's
  trajectory, it waits the moment JAX takes to let go of it (the flush may still be
  running) rather than allocate. A trajectory handed out is never changed behind
  its holder's back.
- :class:`DeviceStorage` (parts already on an accelerator): the jitted pure inserts
  into a donated device state, as a jitted training loop would call them.

Coverage lives in the facade's mirror (:class:`jaxtraj.collector.Mirror`), not here.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtraj import joiner
from jaxtraj.state import CollectorState, init
from jaxtraj.types import EnvPart, PolicyPart, rows_of

try:  # JAX's deferred release of adopted host memory (internal; see _release_dropped)
    from jax._src.lib import _jax as _jax_lib
except ImportError:  # pragma: no cover - an internal module moved
    _jax_lib = None

_ALIGN = 64  # bytes: what XLA's CPU client needs to adopt host memory without a copy


def aligned_zeros(shape: tuple, dtype: Any) -> np.ndarray:
    """A zeroed array whose data starts on a 64-byte boundary.

    Zeroed by ``calloc``: fresh pages arrive zero from the kernel at first touch, so
    this costs no more than uninitialised memory, and no slot ever holds bytes that are
    not a valid value of its dtype (a bool is 0 or 1).
    """
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(n + _ALIGN, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + n].view(dtype).reshape(shape)


def to_device(tree: Any) -> Any:
    """``jax.device_put(tree)`` for a tree of host arrays, at a tenth of its cost.

    ``jax.device_put`` spends ~20-30 us of Python per array before XLA adopts it (zero
    copy on the CPU backend when the memory is 64-byte aligned); a flush hands over
    about twenty. Arrays whose dtype is canonical go to the default device through
    XLA's batched transfer directly (~3 us each, same result: uncommitted, on
    ``jax.local_devices()[0]``); anything else, or a JAX without that entry point, takes
    ``jax.device_put``.
    """
    leaves, treedef = jax.tree.flatten(tree)
    put = _fast_put()
    if put is None:
        return jax.device_put(tree)
    return jax.tree.unflatten(treedef, put(leaves))


@functools.cache
def _fast_put_for(device: Any, x64: bool):
    try:
        from jax._src import core as jcore
        from jax._src.config import explicit_device_put_scope
        from jax._src.lib import xla_client as xc
    except ImportError:  # pragma: no cover - an internal module moved
        return None
    sharding = jax.sharding.SingleDeviceSharding(device)
    avals: dict = {}
    float0 = jax.dtypes.float0

    def put(x: Any) -> Any:
        if type(x) is not np.ndarray:
            return jax.device_put(x)
        key = (x.shape, x.dtype)
        aval = avals.get(key)
        if aval is None:
            dtype = x.dtype
            if (not dtype.isnative or dtype == float0
                    or jax.dtypes.canonicalize_dtype(dtype) != dtype):
                return jax.device_put(x)  # e.g. int64 without x64: converted there
            aval = avals[key] = jcore.ShapedArray(x.shape, dtype)
        return xc.batched_device_put(aval, sharding, [x], [device], False)

    def put_all(leaves: list) -> list:
        # An explicit transfer, as jax.device_put's is (a transfer guard allows it).
        with explicit_device_put_scope():
            return [put(x) for x in leaves]

    try:  # the entry point is internal: check once that it does what device_put does
        probe = np.arange(3, dtype=np.int32)
        (out,), want = put_all([probe]), jax.device_put(probe)
        if not (isinstance(out, jax.Array) and out.sharding == want.sharding
                and out.committed == want.committed and np.array_equal(out, probe)):
            return None
    except Exception:  # noqa: BLE001 - any failure: use the public path
        return None
    return put_all


def _fast_put():
    if jax.config.jax_default_device is not None:
        return None
    return _fast_put_for(jax.local_devices()[0], bool(jax.config.jax_enable_x64))


def _resent(storage: Any, mirror: Any, mode: Any, part: Any) -> bool:
    """Whether every row of ``part`` arrived already with exactly this data (a half
    re-sent after a worker restart); the boundary fields only some halves carry are
    compared when the part has them. A partial overlap is not a re-send."""
    _, e, r, st, t = part.source.key.as_tuple()
    s, off = mirror.index[(r, st)], int(np.asarray(part.source.offset))
    rows = rows_of(part.replace(source=None))
    if not mirror.rows[type(part)][s, e, t, off : off + rows].all():
        return False
    i, at = mode.slot(s, e, t, off)
    kept = storage.read(i, type(part), at, rows)
    if isinstance(part, EnvPart):
        skip = dict(initial_transition=None, next_obs=None, next_rlt_obs=None)
        part, kept = part.replace(**skip), kept.replace(**skip)
        if part.final_values is None:
            part, kept = part.replace(final_values=None), kept.replace(final_values=None)
    sent = jax.tree.leaves(part.replace(source=None))
    return all(np.array_equal(np.asarray(a), b) for a, b in zip(sent, jax.tree.leaves(kept)))


def storage_for(kind, plan, policy_example, env_example, mode, sources, step_id):
    """The storage ``kind`` names for a collector's sources, laid out as ``mode`` says.

    ``"host"``: numpy staging; ``"device"``: jitted inserts into device states;
    ``"auto"``: device when the examples live on an accelerator, else host.
    """
    groups = mode.groups(len(sources))
    make = lambda g: init(
        plan, policy_example, env_example, step_id=step_id,
        sources=mode.state_sources(g, sources),
    )
    if kind == "auto":
        leaves = [x for x in jax.tree.leaves(policy_example) if isinstance(x, jax.Array)]
        accel = any(d.platform != "cpu" for x in leaves for d in x.devices())
        kind = "device" if accel else "host"
    if kind == "host":
        layouts = [jax.eval_shape(lambda g=g: make(g)) for g in groups]
        return HostStorage(layouts, groups, mode.place)
    if kind == "device":
        return DeviceStorage([make(g) for g in groups], groups, plan, mode.place)
    raise ValueError(f"storage must be 'auto', 'host' or 'device', got {kind!r}")


#: Handed-out staging buffers a host storage keeps per state to reuse once their
#: trajectories are dropped: beyond the step being collected, at most this many steps'
#: buffers stay allocated.
SPARES = 2

#: How long a step's first half waits, at most, for JAX to let go of the last step's
#: staging once nothing of the caller's holds it any more (a flush still running, or
#: the release of adopted memory, which lags the flush's outputs by a fraction of a
#: millisecond): far less than allocating and faulting in fresh buffers.
RELEASE_WAIT_S = 0.005


class _Spare(NamedTuple):
    """A step's handed-out staging, kept to reuse: ``users``, weak references to what
    the caller was given (the flush's device arrays, :meth:`HostStorage.state`'s
    views); ``flushed``, an output its flush computed (ready once the flush has run)."""

    state: CollectorState
    users: list
    flushed: Any


def _insert_stack(storage: Any, mode: Any, group: Any, owners: np.ndarray, layout: Any) -> None:
    """Insert a checked stack of parts (a leading axis ``N``), split by the states its
    sources ``owners [N]`` live in."""
    keys = group.source.key
    e, t = np.asarray(keys.epoch_id), np.asarray(keys.chunk_id)
    off = np.broadcast_to(np.asarray(group.source.offset), owners.shape)
    for pick in mode.split(owners):
        whole = isinstance(pick, slice) or pick.all()
        sub = group if whole else jax.tree.map(lambda x, p=pick: np.asarray(x)[p], group)
        if whole:
            pick = slice(None)  # no copies of the index arrays
        i, at = mode.slot(owners[pick], e[pick], t[pick], off[pick])
        leaves, treedef = jax.tree.flatten(sub)
        storage.insert_many(i, at, leaves, treedef, layout)


class _Plan(NamedTuple):
    """How one part structure is stored: ``(buffer, leaf, into initial)`` copies, buffers
    that read zeros when an optional field is absent, and the ``given`` masks to set."""

    copies: tuple
    zeros: tuple
    given: tuple


class HostStorage:
    """Host staging buffers, one :class:`CollectorState` of numpy arrays per state.

    Args:
      layouts: per state, its shapes (``jax.eval_shape`` of ``init``).
      groups: per state, the source indices it holds (one, or all when stacked).
      place: puts a state on its devices at flush time (e.g. sharded over a mesh).
    """

    owned = True  # the buffers handed to a flush are never written again

    def __init__(self, layouts: list[CollectorState], groups: list[list[int]], place=None):
        self.layouts, self.groups = layouts, groups
        self._layouts, self._groups = layouts, groups
        self._place = place or (lambda st: st)
        self._batch = layouts[0].policy_rows.shape[-1]
        self._count = len(jax.tree.leaves((layouts[0].policy, layouts[0].env, layouts[0].initial)))
        self._plans: dict[Any, _Plan] = {}
        self._states: list[CollectorState] = [None] * len(layouts)
        self._flat: list[list[np.ndarray]] = [None] * len(layouts)
        self._given: list[tuple] = [None] * len(layouts)
        self._spares: list[list[_Spare]] = [[] for _ in layouts]
        self._users: list[list] = [[] for _ in layouts]  # the step's, as in _Spare
        self._flushed: list[Any] = [None] * len(layouts)
        # Each state's running episodes (small, [.., B]): carried from flush to flush.
        zeros = lambda x: np.zeros(x.shape, x.dtype)
        self._episodes = [jax.tree.map(zeros, lay.episodes) for lay in layouts]
        for i, lay in enumerate(layouts):
            self._set(i, self._fresh(lay))

    def _set(self, i: int, st: CollectorState) -> None:
        self._states[i] = st
        self._flat[i] = _data(st)
        self._given[i] = (st.next_obs_given, st.next_rlt_given)

    @staticmethod
    def _fresh(layout: CollectorState) -> CollectorState:
        data = lambda tree: jax.tree.map(lambda x: aligned_zeros(x.shape, x.dtype), tree)
        zeros = lambda x: None if x is None else np.zeros(x.shape, x.dtype)
        return layout.replace(
            policy=data(layout.policy),
            env=data(layout.env),
            initial=data(layout.initial),
            next_obs_given=zeros(layout.next_obs_given),
            next_rlt_given=zeros(layout.next_rlt_given),
        )

    def insert(self, i: int, at: tuple, leaves: list, treedef: Any, layout: Any) -> None:
        """Copy one checked half (its flattened ``leaves``) into state ``i`` at
        ``at = (*prefix, e, t, offset)``: one ``np.copyto``-like write per leaf."""
        rows = at[:-1] + (slice(at[-1], at[-1] + layout.rows),)
        self._run(i, treedef, leaves, layout, rows, at[:-3] + (at[-3], rows[-1]))

    def insert_many(self, i: int, at: tuple, leaves: list, treedef: Any, layout: Any) -> None:
        """Copy a stack of checked halves: ``at`` holds index arrays ``[N]`` (prefix, e,
        t, offset)."""
        *lead, e, t, off = at
        if layout.rows == self._batch and not off.any():  # whole rows: 1-D indices, ~3x faster
            rows = (*lead, e, t)
            self._run(i, treedef, leaves, layout, rows, (*lead, e))
            return
        rows = tuple(a[:, None] for a in at[:-1]) + (off[:, None] + np.arange(layout.rows),)
        self._run(i, treedef, leaves, layout, rows, rows[:-3] + (rows[-3], rows[-1]))

    def _run(self, i, treedef, leaves, layout, rows, initial_rows) -> None:
        plan = self._plans.get((treedef, layout))
        if plan is None:
            plan = self._plans[(treedef, layout)] = self._plan(treedef, len(leaves), layout)
        if self._states[i] is None:  # the first half of a step
            self._take(i)
        data, given = self._flat[i], self._given[i]
        where = (rows, initial_rows)
        for dst, src, initial in plan.copies:
            data[dst][where[initial]] = leaves[src]
        for dst in plan.zeros:
            data[dst][rows] = 0
        for j, value in plan.given:
            given[j][rows] = value

    def _plan(self, treedef: Any, n: int, layout: Any) -> _Plan:
        """Which leaf of a part goes to which buffer, worked out once per part structure
        on a probe whose leaves are their own indices."""
        lay = self._layouts[0]
        probe = jax.tree.unflatten(treedef, list(range(n)))
        dest = jax.tree.unflatten(
            jax.tree.structure((lay.policy, lay.env, lay.initial)), list(range(self._count))
        )
        d_policy, d_env, d_initial = dest
        copies, zeros, given = [], [], []
        pair = lambda d, x, initial=False: copies.extend(
            (a, b, initial) for a, b in zip(jax.tree.leaves(d), jax.tree.leaves(x))
        )
        if isinstance(probe, PolicyPart):
            pair(d_policy, probe.replace(source=None))
            return _Plan(tuple(copies), (), ())
        pair(d_env.transition, probe.transition)
        if d_env.action_obs is not None:  # retained: every env half carries them
            pair(d_env.action_obs, probe.action_obs)
        for name, has in (
            ("final_values", layout.has_final),
            ("next_obs", layout.has_next),
            ("next_rlt_obs", layout.has_rlt),
        ):
            if getattr(d_env, name) is None:
                continue
            if has:
                pair(getattr(d_env, name), getattr(probe, name))
            else:  # absent optional fields read as zeros: no stale data
                zeros.extend(jax.tree.leaves(getattr(d_env, name)))
        if lay.next_obs_given is not None:
            given.append((0, layout.has_next))
        if lay.next_rlt_given is not None:
            given.append((1, layout.has_rlt))
        if layout.has_initial:
            pair(d_initial, probe.initial_transition.boundary(), True)
        return _Plan(tuple(copies), tuple(zeros), tuple(given))

    def read(self, i: int, kind: type, at: tuple, rows: int) -> Any:
        """The stored payload of one half's rows (to compare a re-sent half with)."""
        st = self._staging(i)
        sl = at[:-1] + (slice(at[-1], at[-1] + rows),)
        return jax.tree.map(lambda b: b[sl], st.policy if kind is PolicyPart else st.env)

    resent = _resent
    insert_stack = _insert_stack

    def device_state(self, i: int, mirror: Any) -> CollectorState:
        """State ``i`` on its devices: the staging buffers (zero-copy on the CPU backend)
        with a copy of the coverage the mirror records for its sources."""
        st = to_device(self._views(i, mirror))
        self._users[i] += [weakref.ref(x) for x in _data(st)]
        return self._place(st)

    def state(self, i: int, mirror: Any) -> CollectorState:
        """State ``i`` as host arrays: views of the staging buffers (no copy), and a copy of
        the coverage the mirror records for its sources.

        Views, not the buffers' own array objects: whoever holds one (a checkpoint's
        arrays, a device array adopting them) holds the staging's memory, and :meth:`renew`
        does not reuse it while they do."""
        full = self._views(i, mirror)
        self._users[i] += [weakref.ref(x) for x in _data(full)]
        return full

    def _views(self, i: int, mirror: Any) -> CollectorState:
        st, lay, group = self._staging(i), self._layouts[i], self._groups[i]
        pick = (lambda x: x[group]) if len(group) > 1 or lay.stacked else (lambda x: x[group[0]])
        copy = lambda x: None if x is None else x.copy()
        view = lambda tree: jax.tree.map(lambda x: x.view(), tree)
        full = st.replace(
            policy=view(st.policy),
            env=view(st.env),
            initial=view(st.initial),
            policy_rows=np.array(pick(mirror.rows[PolicyPart])),
            env_rows=np.array(pick(mirror.rows[EnvPart])),
            next_obs_given=copy(st.next_obs_given),
            next_rlt_given=copy(st.next_rlt_given),
            sources=np.asarray(pick(mirror.sources), np.int32),
            step=np.asarray(pick(mirror.step), np.int32),
            errors=np.zeros(lay.errors.shape, np.int32),
            # A device copy (async): the flush may donate what it is given.
            episodes=jax.tree.map(jnp.array, self._episodes[i]),
        )
        return full

    def after_flush(self, i: int, state: CollectorState) -> None:
        # Coverage is the mirror's; the buffers are renewed when the step ends. The
        # running episodes move on, kept where the flush left them: reading them back
        # here would wait for the flush (the episode statistics) before the next add.
        self._episodes[i] = state.episodes
        self._flushed[i] = state.errors

    def renew(self, i: int) -> None:
        """State ``i``'s step ended: the buffers just handed out join the spares, and the
        next step's staging is taken at its first use (:meth:`_take`), so that a
        trajectory dropped by then gives its warm buffers straight back."""
        if self._states[i] is not None:  # else nothing was taken since the last renew
            self._spares[i].append(_Spare(self._states[i], self._users[i], self._flushed[i]))
            del self._spares[i][: -(SPARES + 1)]
        self._states[i], self._users[i], self._flushed[i] = None, [], None

    def _staging(self, i: int) -> CollectorState:
        st = self._states[i]
        return self._take(i) if st is None else st

    def _take(self, i: int) -> CollectorState:
        """Staging for state ``i``'s step: the most recently handed-out spare that
        nothing references any more (its trajectory was dropped: warm memory, no
        allocation), or fresh buffers; at most :data:`SPARES` spares stay allocated. A
        caller that holds the latest trajectory while the next step is collected still
        gets recycled buffers."""
        _release_dropped()
        pool = self._spares[i]
        if pool and not _free(pool[-1]) and not any(u() is not None for u in pool[-1].users):
            # The caller dropped all it was given of the latest step; what still holds
            # its memory is JAX, for a moment: wait for it rather than allocate.
            _wait_released(pool[-1])
        free = [n for n, sp in enumerate(pool) if _free(sp)]
        if not free:
            st = self._fresh(self._layouts[i])
        else:
            reuse = pool.pop(free[-1]).state
            zero = lambda x: None if x is None else np.zeros_like(x)
            st = reuse.replace(
                next_obs_given=zero(reuse.next_obs_given),
                next_rlt_given=zero(reuse.next_rlt_given),
            )
        del pool[:-SPARES]
        self._set(i, st)
        return st

    def load(self, i: int, state: CollectorState) -> None:
        """Replace state ``i``'s staging with ``state``'s data (a checkpoint). Host arrays
        that can serve as staging (aligned, writable, of the layout's shape and dtype) are
        adopted as they are; anything else is copied into fresh staging."""
        lay = self._layouts[i]
        tree = jax.tree.structure((lay.policy, lay.env, lay.initial))

        def adopt(want, x):
            if (isinstance(x, np.ndarray) and x.flags.writeable and x.flags.c_contiguous
                    and x.ctypes.data % _ALIGN == 0 and x.shape == want.shape
                    and x.dtype == want.dtype):
                return x
            out = aligned_zeros(want.shape, want.dtype)
            np.copyto(out, np.asarray(x))
            return out

        data = [adopt(w, x) for w, x in zip(jax.tree.leaves((lay.policy, lay.env, lay.initial)),
                                           jax.tree.leaves((state.policy, state.env, state.initial)))]
        policy, env, initial = jax.tree.unflatten(tree, data)
        given = lambda x: None if x is None else np.array(x)
        self._episodes[i] = jax.tree.map(np.array, state.episodes)
        self._users[i], self._flushed[i] = [], None
        self._set(i, lay.replace(
            policy=policy, env=env, initial=initial,
            next_obs_given=given(state.next_obs_given), next_rlt_given=given(state.next_rlt_given),
        ))


def _data(st: CollectorState) -> list[np.ndarray]:
    return jax.tree.leaves((st.policy, st.env, st.initial))


def _free(spare: _Spare) -> bool:
    return all(_unshared(x) for x in _data(spare.state))


def _wait_released(spare: _Spare) -> None:
    """Wait until ``spare``'s flush has run and JAX has let go of its staging, or at
    most :data:`RELEASE_WAIT_S`."""
    jax.block_until_ready(spare.flushed)
    end = time.monotonic() + RELEASE_WAIT_S
    while True:
        _release_dropped()
        if _free(spare) or time.monotonic() > end:
            return
        time.sleep(50e-6)


def _release_dropped() -> None:
    """Let go of host memory that dropped device arrays had adopted.

    JAX defers releasing a numpy array that a device array adopted (zero-copy on the
    CPU backend) until its next garbage collection, so a trajectory the caller has
    dropped still holds its staging buffers until then; this releases them now."""
    collect = getattr(_jax_lib, "collect_garbage", None)
    if collect is not None:
        collect()


def _unshared(x: np.ndarray) -> bool:
    """Whether only ``x`` holds its memory: no device array adopted it, no view of it
    was handed out (CPython reference count of the owning buffer)."""
    return sys.getrefcount(x.base) <= 2  # x's own reference and the call's argument


class DeviceStorage:
    """Device states, written by the jitted pure inserts (state donated)."""

    owned = False

    def __init__(self, states: list[CollectorState], groups: list[list[int]], plan: Any,
                 place=None):
        place = place or (lambda st: st)
        self._states = [place(st) for st in states]
        self.groups = groups
        self.layouts = [jax.eval_shape(lambda st=st: st) for st in states]
        self.plan = plan

    def insert(self, i: int, at: tuple, leaves: list, treedef: Any, layout: Any) -> None:
        part = jax.tree.unflatten(treedef, leaves)
        self._states[i] = _ADD[type(part)](self.plan, self._states[i], part)

    def insert_many(self, i: int, at: tuple, leaves: list, treedef: Any, layout: Any) -> None:
        parts = jax.tree.unflatten(treedef, leaves)
        self._states[i] = _ADD_MANY[type(parts)](self.plan, self._states[i], parts)

    def read(self, i: int, kind: type, at: tuple, rows: int) -> Any:
        st = self._states[i]
        sl = at[:-1] + (slice(at[-1], at[-1] + rows),)
        tree = st.policy if kind is PolicyPart else st.env
        return jax.tree.map(lambda b: np.asarray(b[sl]), tree)

    resent = _resent
    insert_stack = _insert_stack

    def device_state(self, i: int, mirror: Any) -> CollectorState:
        return self._states[i]

    def after_flush(self, i: int, state: CollectorState) -> None:
        self._states[i] = state

    def renew(self, i: int) -> None:
        pass  # the flush cleared the coverage on device; the buffers are reused

    def state(self, i: int, mirror: Any) -> CollectorState:
        return self._states[i]

    def load(self, i: int, state: CollectorState) -> None:
        self._states[i] = jax.device_put(state)


_jit = functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
_ADD = {PolicyPart: _jit(joiner.add_policy), EnvPart: _jit(joiner.add_env)}
_ADD_MANY = {PolicyPart: _jit(joiner.add_policies), EnvPart: _jit(joiner.add_envs)}

