"""Pipeline mode: advantage-ready micro-batches per Actor rank.

Completion scope: one ``(step_id, epoch_id)`` across every source. The flush is one
jitted function over the stacked state (sources ``[S, ...]``): it materialises the
epoch of every source, computes advantages and returns with the same kernels the
Actor uses in rollout mode (:func:`jaxtraj.targets.trajectory_targets`), normalises
advantages over the valid rows of all sources (and devices), shuffles the samples
with a caller-given PRNG key, and packs them for ``R`` Actor ranks::

    leaves [R, micro_batches, micro_batch_size, ...]      loss_mask [R, MB, M]

Sample ``i`` of the shuffled order (valid samples first) goes to rank ``i % R``, so
padding spreads over the ranks; every valid sample appears exactly once with
``loss_mask`` true. When the last epoch of a step is flushed, the step's coverage
clears and every source moves to the next step.

Given a ``jax.sharding.Mesh`` (:func:`make_flush`), the state's sources are sharded
over one mesh axis and the micro-batches come out sharded over the ``actor`` axis;
the computation is the same global program, so the results equal one device's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtraj import advantages as adv_lib
from jaxtraj.errors import ErrorCode
from jaxtraj.modes._layout import Stacked
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.state import CollectorState, materialize_running, record_error, slot_complete
from jaxtraj.targets import trajectory_targets
from jaxtraj.types import Trajectory, TrajectoryKey


@struct.dataclass
class MicroBatches:
    """Samples of one epoch packed per Actor rank: every leaf ``[R, MB, M, ...]`` as the
    mode makes them; the collector hands each Actor rank its own, without the ``R`` axis
    (queue ``"actor_<r>"``: leaves ``[MB, M, ...]``, ``step_id`` and ``epoch_id`` scalars,
    ``episodes`` ``[S, T, B, K]``), and ``stack_ranks`` puts the axis back.

    A sample is one chunk of one environment. ``prev_values`` is ``V(s_t)``;
    ``advantages`` are normalised when the plan says so; ``loss_mask`` is false on
    padding (and on rows after a done without auto-reset). ``action_mask``
    ``[R, MB, M, K]`` says which actions of a sample's chunk its decision owns and that
    ran (false on padding; ``None`` where every field is chunk-level): mask
    per-action log-probabilities with it. ``step_id`` and ``epoch_id`` are ``[R]``.
    ``extras`` holds the per-chunk fields a plan's ``trajectory_type`` adds (leaves
    ``[E, T, B, ...]`` in the trajectory), packed alike. ``episodes`` are the episodes
    that ended in the epoch, every source (:class:`jaxtraj.EpisodeStats`, leaves
    ``[R, S, T, B, K]``: every rank's item holds them all, so log one rank's: a
    ``stack_ranks`` of several ranks' items lists each episode once per rank).
    """

    obs: Any
    actions: jax.Array
    prev_logprobs: jax.Array | None
    prev_values: jax.Array | None
    versions: jax.Array | None
    forward_inputs: Any
    advantages: jax.Array
    returns: jax.Array
    rewards: jax.Array
    loss_mask: jax.Array
    step_id: jax.Array
    epoch_id: jax.Array
    extras: dict
    action_mask: jax.Array | None = None
    episodes: Any = None


@struct.dataclass
class PipelineState:
    """Pipeline mode's own state: the shuffle key and the epochs flushed this step.

    Epoch ``e`` of step ``k`` is shuffled with ``fold_in(fold_in(rng, k), e)``, so the
    output does not depend on the order in which epochs complete.
    """

    rng: jax.Array
    flushed: jax.Array  # [E] bool


def init(plan: TrajectoryPlan, rng: jax.Array | None = None) -> PipelineState:
    """Pipeline mode's state: ``rng`` (default ``PRNGKey(0)``), nothing flushed."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return PipelineState(rng=rng, flushed=jnp.zeros((plan.num_epochs,), bool))


_BASE_FIELDS = {f.name for f in dataclasses.fields(Trajectory)}


def packing(plan: TrajectoryPlan, num_samples: int) -> tuple[int, int]:
    """``(micro_batches, micro_batch_size)`` for ``num_samples`` samples over the ranks."""
    R = plan.actor_ranks
    M = plan.micro_batch_size or math.ceil(num_samples / R)
    return math.ceil(num_samples / (R * M)), M


def ready(state: CollectorState, mode_state: PipelineState) -> jax.Array:
    """``[E]`` bool: epochs of the current step complete across every source and not
    yet flushed."""
    st = _stacked(state)
    return jnp.all(slot_complete(st), axis=(0, 2)) & ~mode_state.flushed


def _stacked(state: CollectorState) -> CollectorState:
    return state if state.stacked else jax.tree.map(lambda x: x[None], state)


def flush(
    plan: TrajectoryPlan,
    state: CollectorState,
    mode_state: PipelineState,
    epoch: Any,
    current_version: Any = 0,
    recycle: MicroBatches | None = None,
    *,
    _row_loop: bool = True,
) -> tuple[MicroBatches, CollectorState, PipelineState]:
    """Flush one epoch of every source as micro-batches per Actor rank.

    Args:
      plan: the static plan (``actor_ranks``, ``micro_batch_size``, advantage settings).
      state: the stacked collector state (donate it).
      mode_state: the :class:`PipelineState` (shuffle key, epochs flushed).
      epoch: the epoch to flush (int or traced int32).
      current_version: the policy version now training; with ``plan.max_staleness``
        set, older samples get a false ``loss_mask``.
      recycle: micro-batches of an earlier flush of this plan that the caller no longer
        uses (donate them), or ``None``. Their buffers take the new samples in place: no
        fresh allocation (on a CPU, no first-touch page faults; on a GPU, no allocator
        traffic). Donated, they are consumed even when the epoch is not flushed. On a
        CPU, batches read with ``jax.device_get`` are copied rather than reused (see
        :mod:`jaxtraj.modes.rollout`).

    Returns:
      ``(micro_batches, state, mode_state)``. An incomplete or already flushed epoch
      records ``INCOMPLETE_SCOPE`` and changes nothing else; discard the micro-batches.

    Raises:
      ValueError: ``recycle`` is not micro-batches of this plan (structure, shape or
        dtype of a field), naming the field.
    """
    single = not state.stacked
    state = _stacked(state)
    e = jnp.asarray(epoch, jnp.int32)
    ok = ready(state, mode_state)[e]
    rng = jax.random.fold_in(jax.random.fold_in(mode_state.rng, state.step[0]), e)
    # Materialise every epoch without slicing: the per-chunk fields are the buffers
    # themselves, so the only copy of the big fields is the final packing.
    trajs, running = jax.vmap(lambda st: materialize_running(plan, st))(state)  # [S, E, ...]
    targets = jax.vmap(lambda tr: trajectory_targets(plan, tr, current_version))(trajs)

    S, E, T, B = state.sources.shape[0], plan.num_epochs, plan.num_chunks, plan.batch_size
    N = S * T * B  # samples of one epoch
    flat = lambda x: x.reshape((S * E * T * B,) + x.shape[4:])  # [S, E, T, B, ...] -> rows
    # Row of epoch-local sample n = (s, t, b) in the flattened buffers.
    s_i, t_i, b_i = jnp.unravel_index(jnp.arange(N), (S, T, B))
    rows = ((s_i * E + e) * T + t_i) * B + b_i
    valid = flat(targets.valid)[rows]
    advantages = flat(targets.advantages)[rows]
    norm = plan.advantage_normalization
    if norm == "global":  # over every valid sample of the epoch: all sources, all devices
        advantages = adv_lib.normalize_advantages(advantages, valid)
    samples = dict(
        obs=trajs.obs,
        actions=trajs.actions,
        prev_logprobs=trajs.prev_logprobs,
        prev_values=None if trajs.prev_values is None else trajs.prev_values[:, :, :T],
        versions=trajs.versions,
        forward_inputs=trajs.forward_inputs,
        returns=targets.returns,
        rewards=targets.rewards,
        action_mask=targets.action_mask,
        # Fields a plan's trajectory_type adds: per-chunk leaves [S, E, T, B, ...].
        extras={
            f.name: getattr(trajs, f.name)
            for f in dataclasses.fields(trajs)
            if f.name not in _BASE_FIELDS and getattr(trajs, f.name) is not None
        },
    )

    R = plan.actor_ranks
    MB, M = packing(plan, N)
    total = R * MB * M
    order = shuffle_valid_first(rng, valid)
    # Position i of the shuffled order goes to rank i % R, place i // R within it; the
    # padding positions N .. total-1 read zeros and a false loss_mask.
    place = lambda i: (i % R) * (MB * M) + i // R
    flat_samples = jax.tree.map(flat, samples)
    leaves, tree = jax.tree.flatten(flat_samples)
    if recycle is None:  # fresh outputs: a gather creates them in one pass
        packed = _pack_gather(N, place, leaves, total, rows, order)
    else:  # the recycled batches' buffers take this epoch's samples, in place
        base = {name: getattr(recycle, name) for name in samples}
        if jax.tree.structure(base) != tree:
            raise ValueError(
                f"recycle: not micro-batches of this plan: {jax.tree.structure(base)} "
                f"against {tree}"
            )
        named = jax.tree_util.tree_flatten_with_path(base)[0]
        for (path, b), x in zip(named, leaves):
            want = ((R, MB, M) + x.shape[1:], x.dtype)
            if (tuple(b.shape), b.dtype) != want:
                raise ValueError(
                    f"recycle{jax.tree_util.keystr(path)}: {b.dtype}{list(b.shape)}, this plan's "
                    f"micro-batches have {want[1]}{list(want[0])}"
                )
        bases = [b.reshape((total,) + x.shape[1:]) for (_, b), x in zip(named, leaves)]
        if _row_loop:
            packed = jax.lax.platform_dependent(
                leaves, bases, rows, order,
                cpu=functools.partial(_pack_rows, N, place),
                default=lambda leaves, *_: _pack_gather(N, place, leaves, total, rows, order),
            )
        else:  # under a mesh a row loop would make the partitioner gather every source's
            # buffers onto every device
            packed = _pack_gather(N, place, leaves, total, rows, order)
    packed = [x.reshape((R, MB, M) + x.shape[1:]) for x in packed]
    fields = jax.tree.unflatten(tree, packed)
    small = _pack_gather(N, place, [advantages, valid], total, jnp.arange(N), order)
    advantages, loss_mask = (x.reshape(R, MB, M) for x in small)
    if norm == "per_rank":  # over each Actor rank's own batches (local to its shard)
        advantages = jax.vmap(adv_lib.normalize_advantages)(advantages, loss_mask)
    per_rank = lambda v: jnp.full((R,), v, jnp.int32)
    # The episodes that ended in this epoch, every source: [S, T, B, K]. Their sums run
    # over the step's epochs in time order from the step's start (the state advances them
    # when the step's last epoch is flushed).
    # Every rank's item holds them all (leading [R], as every field): log one rank's.
    stats = trajs.episodes
    of_epoch = lambda x: x[:, e] if x.ndim > 1 else x  # [S, E, ...] -> [S, ...]
    episodes = jax.tree.map(lambda x: jnp.broadcast_to(of_epoch(x), (R,) + of_epoch(x).shape),
                            stats)
    batches = MicroBatches(
        **fields,
        episodes=episodes,
        advantages=advantages,
        loss_mask=loss_mask,
        step_id=per_rank(state.step[0]),
        epoch_id=per_rank(e),
    )

    flushed = mode_state.flushed.at[e].set(mode_state.flushed[e] | ok)
    step_done = jnp.all(flushed)
    keep = lambda rows: jnp.where(step_done, False, rows)
    new = state.replace(
        policy_rows=keep(state.policy_rows),
        env_rows=keep(state.env_rows),
        next_obs_given=None if state.next_obs_given is None else keep(state.next_obs_given),
        next_rlt_given=None if state.next_rlt_given is None else keep(state.next_rlt_given),
        step=state.step + step_done.astype(jnp.int32),
        episodes=jax.tree.map(lambda old, new: jnp.where(step_done, new, old),
                              state.episodes, running),
    )
    key = TrajectoryKey(state.step[0], e, -1, -1, -1)
    code = jnp.where(ok, 0, int(ErrorCode.INCOMPLETE_SCOPE)).astype(jnp.int32)
    new = record_error(new, code, key, 0)
    if single:
        new = jax.tree.map(lambda x: x[0], new)
    return batches, new, mode_state.replace(flushed=keep(flushed))


def shuffle_valid_first(
    rng: jax.Array, valid: jax.Array, random_bits: int | None = None, rounds: int | None = None
) -> jax.Array:
    """A uniformly random order of ``N`` samples with the valid ones first: ``int32[N]``.

    Each round sorts one ``uint32`` key per sample, its random bits above its current
    place (a sort of bare keys is 5-6x faster on XLA's CPU backend than one that carries
    a second key or the indices alongside). A round orders samples with equal random
    bits by their place from the round before, which is random; only a pair tied in
    every round keeps its first order, so the rounds are chosen to make that unlikely:
    ``(N^2/2) * 2^-(r * rounds) <= 2^-11`` with ``r`` random bits a round (two rounds
    at N = 8192). The last round's top bit puts the invalid samples last. Beyond
    ``2^20`` samples: one sort on a random 31-bit key and 32 more random bits, with the
    indices alongside.

    Args:
      random_bits: random bits a round (default: what the key leaves beside the place
        and the invalid flag); tests lower it to exercise ties.
      rounds: the number of rounds (default: those that bound ties as above); tests
        lower it too.
    """
    N = valid.shape[0]
    b = max(1, (N - 1).bit_length())  # bits of a place
    r = 31 - b if random_bits is None else min(random_bits, 31 - b)
    if b > 20 or r < 1:
        bits = jax.random.bits(rng, (2, N), jnp.uint32)
        first = ((~valid).astype(jnp.uint32) << 31) | (bits[0] >> 1)
        return jax.lax.sort((first, bits[1], jnp.arange(N, dtype=jnp.int32)), num_keys=2)[-1]
    rounds = rounds or max(1, -(-(2 * b + 10) // r))
    bits = jax.random.bits(rng, (rounds, N), jnp.uint32) >> (32 - r)
    place = jnp.arange(N, dtype=jnp.uint32)
    order = jnp.arange(N, dtype=jnp.int32)
    for k in range(rounds):
        key = (bits[k] << b) | place  # place: this sample's position in `order` so far
        if k == rounds - 1:
            key = key | ((~valid[order]).astype(jnp.uint32) << 31)
        order = order[(jax.lax.sort(key) & ((1 << b) - 1)).astype(jnp.int32)]
    return order


def _pack_rows(N, place, leaves, bases, rows, order):
    """Pack into recycled buffers on a CPU: per leaf, one loop over the samples copies
    row ``rows[n]`` to its packed place, in the order the buffers hold them (a
    sequential read, one write per output byte, in place into the donated ``bases``).
    Measured on XLA's CPU backend: its row gather runs at about a quarter of memory
    speed, and its scatter first copies the updates when they are a reshaped buffer."""
    dest = jnp.zeros((N,), jnp.int32).at[order].set(place(jnp.arange(N, dtype=jnp.int32)))
    total = bases[0].shape[0] if bases else 0
    pad = place(np.arange(N, total))

    def copy_rows(x, out):  # one loop per leaf: measured faster than one loop for all
        def body(n, out):
            row = jax.lax.dynamic_index_in_dim(x, rows[n], 0)
            return jax.lax.dynamic_update_index_in_dim(out, row, dest[n], 0)

        return jax.lax.fori_loop(0, N, body, out)

    outs = [copy_rows(x, b) for x, b in zip(leaves, bases)]
    if len(pad):
        outs = [o.at[pad].set(jnp.zeros((), o.dtype), unique_indices=True) for o in outs]
    return outs


def _pack_gather(N, place, leaves, total, rows, order):
    """Pack with one gather per leaf, straight into its packed place (on a GPU or TPU
    always; on a CPU for fresh outputs, where the gather's first-touch page faults cost
    more than its random reads, and under a mesh)."""
    i = jnp.arange(total)
    # Packed place p holds shuffled position i with place(i) = p: invert place().
    pos = jnp.zeros((total,), jnp.int32).at[place(i)].set(i.astype(jnp.int32))
    src = rows[order[jnp.minimum(pos, N - 1)]]
    # Padding reads one past the end: the gather fills it with zeros.
    return [x.at[jnp.where(pos < N, src, x.shape[0])].get(mode="fill", fill_value=0)
            for x in leaves]


def make_flush(
    plan: TrajectoryPlan,
    mesh: Mesh | None = None,
    *,
    source_axis: str = "sources",
    actor_axis: str = "actor",
    donate: bool = True,
):
    """The jitted pipeline flush
    ``(state, mode_state, epoch, current_version=0, recycle=None) -> (batches, state,
    mode_state)``.

    The state and ``recycle`` are donated (unless ``donate=False``). Without a mesh:
    ``jax.jit``. With one: the state's sources
    are sharded over ``source_axis`` (place it with :func:`shard_state`) and every
    micro-batch leaf comes out sharded over ``actor_axis`` on its leading rank axis.

    Raises:
      ValueError: a named axis is not in the mesh, or ``actor_ranks`` does not
        divide over the actor axis.
    """
    if mesh is None:
        return jax.jit(functools.partial(flush, plan), donate_argnums=(0, 4) if donate else ())
    fn = functools.partial(flush, plan, _row_loop=False)
    for name, axis in (("source_axis", source_axis), ("actor_axis", actor_axis)):
        if axis not in mesh.axis_names:
            raise ValueError(f"{name}={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    if plan.actor_ranks % mesh.shape[actor_axis]:
        raise ValueError(
            f"actor_ranks={plan.actor_ranks} does not divide over the mesh axis "
            f"{actor_axis!r} of size {mesh.shape[actor_axis]}"
        )
    state_sharding = NamedSharding(mesh, P(source_axis))
    out = (NamedSharding(mesh, P(actor_axis)), state_sharding, NamedSharding(mesh, P()))
    return jax.jit(fn, donate_argnums=(0, 4) if donate else (), out_shardings=out)


def shard_state(state: CollectorState, mesh: Mesh, source_axis: str = "sources") -> CollectorState:
    """Place a stacked state on ``mesh`` with its sources sharded over ``source_axis``."""
    if source_axis not in mesh.axis_names:
        raise ValueError(
            f"source_axis={source_axis!r} is not an axis of the mesh {dict(mesh.shape)}"
        )
    S, n = state.sources.shape[0], mesh.shape[source_axis]
    if not state.stacked or S % n:
        raise ValueError(
            f"the state's {S if state.stacked else 1} source(s) do not divide over the mesh "
            f"axis {source_axis!r} of size {n}"
        )
    return jax.device_put(state, NamedSharding(mesh, P(source_axis)))


def global_state(local: CollectorState, mesh: Mesh, source_axis: str = "sources") -> CollectorState:
    """Multi-host: every process's local stacked state, as one global state.

    Each process owns some sources and inserts their parts locally; at flush time the
    local states (equal source counts, in process order) form global arrays sharded
    over ``source_axis`` of a mesh that spans the processes. Every process calls this
    and the flush together, in the same order (they are collective programs).
    """
    if source_axis not in mesh.axis_names:
        raise ValueError(
            f"source_axis={source_axis!r} is not an axis of the mesh {dict(mesh.shape)}"
        )
    sharding = NamedSharding(mesh, P(source_axis))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)


def local_state(state: CollectorState) -> CollectorState:
    """Multi-host: this process's sources of a global state, as local arrays."""
    return jax.tree.map(lambda x: jax.device_put(x.addressable_shards[0].data), state)


@dataclasses.dataclass(frozen=True)
class Pipeline(Stacked):
    """Pipeline mode in the common form of :mod:`jaxtraj.modes`; scopes are epochs.

    Args:
      plan: the plan.
      rng: the shuffle key (default ``PRNGKey(0)``).
      mesh: several devices: sources sharded over ``source_axis``, micro-batches over
        ``actor_axis``. With several processes (``jax.distributed``) each process's
        collector holds its own sources, and every process flushes each epoch
        together, in the same order.
      source_axis: the mesh axis the sources are sharded over.
      actor_axis: the mesh axis the micro-batches (Actor ranks) are sharded over.
    """

    plan: TrajectoryPlan
    rng: Any = None
    mesh: Mesh | None = None
    source_axis: str = "sources"
    actor_axis: str = "actor"

    @property
    def multihost(self) -> bool:
        return self.mesh is not None and jax.process_count() > 1

    # -- pure ---------------------------------------------------------------------------

    def init(self, state: CollectorState) -> PipelineState:
        return init(self.plan, self.rng)

    def ready(self, state: CollectorState, mode_state: PipelineState) -> jax.Array:
        return ready(state, mode_state)

    def flush(self, state, mode_state, scope, current_version=0):
        return flush(self.plan, state, mode_state, scope, current_version)

    # -- host ---------------------------------------------------------------------------

    def place(self, state: CollectorState) -> CollectorState:
        """Where the facade keeps the state: sharded over the mesh on one process."""
        if self.mesh is not None and not self.multihost:
            return shard_state(state, self.mesh, self.source_axis)
        return state

    def end(self, mode_state: Any, state_index: int) -> tuple[list, Any]:
        """Nothing runs between epochs: nothing to hand over."""
        return [], mode_state

    def restored(self, mode_states: list) -> None:
        """After ``load_state_dict``: no host bookkeeping to rebuild."""

    def scopes(self, mirror) -> list[int]:
        done = mirror.complete().all(axis=0) & ~mirror.flushed
        return [int(e) for e in np.flatnonzero(done)]

    def state_index(self, scope: int) -> int:
        return 0

    def scope_name(self, scope: int, mirror) -> int:
        """The facade names an epoch scope by its epoch."""
        return scope

    def scope_index(self, name: Any, mirror) -> int | None:
        e = int(name[0] if isinstance(name, tuple) else name)
        return e if 0 <= e < self.plan.num_epochs else None

    def describe(self, scope: int, mirror) -> tuple:
        return (int(mirror.step[0]), int(scope), -1, -1, -1)

    def compiled_flush(self, state, mode_state, scope, current_version, *, owned: bool):
        fn = _compiled(self.plan, self.mesh, self.source_axis, self.actor_axis, not owned)
        if self.multihost:
            state = global_state(state, self.mesh, self.source_axis)
        batches, state, mode_state = fn(state, mode_state, scope, current_version)
        if self.multihost:
            state = local_state(state)
        return batches, state, mode_state

    def emit(self, items: MicroBatches, scope: int, mirror) -> list[tuple[str, Any]]:
        """One item per Actor rank this process holds: leaves ``[MB, M, ...]``. On one
        process, every rank; with several, the ranks whose shards are on its devices."""
        R = self.plan.actor_ranks
        if not self.multihost:
            return [(f"actor_{r}", jax.tree.map(lambda x, r=r: x[r], items)) for r in range(R)]
        local: dict[int, list] = {}
        leaves, tree = jax.tree.flatten(items)
        for i, leaf in enumerate(leaves):
            for shard in leaf.addressable_shards:
                first = shard.index[0].start or 0
                for j in range(shard.data.shape[0]):
                    local.setdefault(first + j, [None] * len(leaves))[i] = shard.data[j]
        return [(f"actor_{r}", jax.tree.unflatten(tree, local[r])) for r in sorted(local)]

    def advance(self, scope: int, mirror) -> list[int]:
        mirror.flushed[scope] = True
        if not mirror.flushed.all():
            return []
        mirror.clear_all()
        return [0]


@functools.cache
def _compiled(plan, mesh, source_axis, actor_axis, donate):
    return make_flush(plan, mesh, source_axis=source_axis, actor_axis=actor_axis, donate=donate)
