"""The service-loop contract every host runner shares: one contract, several transports.

A host runner (threads in one process, :mod:`jaxtraj.runners.threads`; Ray actors across
machines, :mod:`jaxtraj.runners.ray`) moves the same two halves of a chunk from its
producers to one consumer that feeds a :class:`~jaxtraj.TrajectoryCollector`. What does
not depend on the transport lives here:

- the environment protocol (:class:`Env`, :class:`EnvStep`) and the policy signature;
- the keys an env rank produces, in order (:func:`chunk_keys`);
- the policy signature and key-derived randomness (:data:`PolicyFn`, :func:`key_rng`,
  :func:`row_rngs`, :func:`key_rngs`): a chunk's PRNG key depends on its key alone, and
  each of its rows gets a key of its own split from it, never from arrival order, from
  which process computed it or from which other chunks shared the policy call, so every
  transport and every batching produces the same trajectories;
- how the policy side batches the chunks of several env ranks into one call
  (:func:`join_rows`, :func:`split_rows`);
- how an :class:`EnvStep` becomes an :class:`EnvPart` (:func:`env_part`: chunk 0 carries
  the previous chunk's boundary flags) and how a policy output is stamped with the model
  version (:func:`stamp_versions`);
- the consumer (:class:`Consumer`): holds a next-step half until its step is current,
  delivers flushed items to ``on_flush``, an output queue or a list, and turns a rejected
  half into :class:`RunnerError` naming the worker and the key.
"""

from __future__ import annotations

import functools
import math
import numbers
import queue
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxtraj import checks
from jaxtraj.collector import TrajectoryCollector
from jaxtraj.errors import CollectorError, ErrorCode
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.types import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)

PyTree = Any


class RunnerError(RuntimeError):
    """A runner worker failed; every worker was stopped.

    Attributes:
      worker: the failing worker's name (``"env_worker_2"``, ``"policy_worker"``,
        ``"consumer"``, ``"on_flush"``, ``"output_queue"``).
      key: the ``(step_id, epoch_id, env_rank, stage_id, chunk_id)`` it was working on,
        or ``None``.
      cause: the original exception (also ``__cause__``).
      delivered: how many flushed items were delivered (to ``on_flush`` or
        ``output_queue``) before the failure.
      what: what it failed on where that is not a chunk (a flushed item: ``"queue
        'default', step 3, env rank 1"``), or ``None``.
      undelivered: the ``(queue_key, item)`` pairs the collector flushed that the run
        did not hand over, in flush order: the items ``run()`` would have returned (a
        rank's step complete before the failure), or those not delivered (``on_flush``
        raised, or the run stopped while ``output_queue`` was full). Out of the
        collector, so only here.
    """

    def __init__(self, worker: str, key: tuple | None, cause: BaseException, delivered: int = 0,
                 undelivered: Sequence[tuple[str, Any]] = (), what: str | None = None):
        self.worker, self.key, self.cause, self.delivered = worker, key, cause, delivered
        self.undelivered, self.what = list(undelivered), what
        # A terminal's colour codes (Ray's errors carry them) are not part of the message.
        said = _COLOUR.sub("", str(cause))
        where = (f" on {what}" if what is not None else "" if key is None else
                 f" at key {key}")  # no key: before or between chunks (an env being built)
        msg = f"{worker} failed{where}: {type(cause).__name__}: {said}"
        if self.undelivered:
            msg += (f" ({len(self.undelivered)} flushed item(s) not delivered: on this "
                    "error's `undelivered`)")
        super().__init__(msg)

    @property
    def delivery(self) -> bool:
        """Whether it is a flushed item not delivered (the half that flushed it is in)."""
        return self.worker in ("on_flush", "output_queue")


_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class EnvStep:
    """What an environment returns for one executed chunk of ``K`` actions.

    The env reports what happened; the policy side resolves the next observation and
    runs terminal inference (``value_fn(params, final_obs)``), so an env worker never
    needs the critic.

    Attributes:
      transition: the chunk's :class:`EnvTransition`, rows ``[B]``: rewards, and
        terminations / truncations ``[B, K]`` (or ``[B]``), the environment's own.
      obs: the observation the next chunk's policy sees (after any auto-reset).
      final_values: ``[B]`` ``V(final obs)``, only for envs that run terminal inference
        themselves; else ``None`` and the runner's ``value_fn`` computes it.
      next_obs: an explicit post-action observation (terminal boundary override).
      final_obs: leaves ``[B, ...]``: where an episode ended in the chunk, the
        observation it ended on (the last one, if several ended); elsewhere equal to
        ``obs``. Terminal inference reads it, and with ``collect_transitions`` it is
        the step's ``next_obs``.
      action_obs: leaves ``[B, K, ...]``, the observation each action of the chunk was
        taken from (action 0's is the chunk's ``PolicyPart.obs``; after an episode
        ended at action ``k``, action ``k + 1``'s is the new episode's reset
        observation). Only when asked for (LeRobot frames need them).
      info: ``{name: [B, K]}`` per-action values an adapter was asked to keep from the
        environment's ``info`` (``is_success``, ...).
    """

    transition: EnvTransition
    obs: PyTree
    final_values: Any = None
    next_obs: PyTree = None
    final_obs: PyTree = None
    action_obs: PyTree = None
    info: dict | None = None


class Env(Protocol):
    """One environment rank: ``B`` vectorised environments (host callables)."""

    def reset(self) -> PyTree:
        """The first observation, leaves ``[B, ...]``."""

    def step(self, key: TrajectoryKey, actions: Any) -> EnvStep:
        """Execute one action chunk ``[B, K, A]`` for chunk ``key``."""


PolicyFn = Callable[[Any, PyTree, jax.Array], PolicyOutput]
"""``policy_fn(params, obs, rng) -> PolicyOutput``, every runner's policy signature.

``obs`` leaves are ``[N, ...]`` and ``rng`` is ``[N, 2]`` ``uint32``: one PRNG key per
row, so a row's sample depends on its own key alone, never on which other rows share
the call. The host runners join several env ranks' chunks into one call (``N`` is a
multiple of the plan's ``batch_size`` ``B``); the synchronous runner calls it per chunk
(``N = B``). Sample per row, e.g.
``noise = jax.vmap(lambda k: jax.random.normal(k, (K, A)))(rng)``; never draw one array
of ``N`` rows from ``rng[0]``. The output's leaves are ``[N, ...]`` (``actions
[N, K, A]``).

Row keys: chunk ``key``'s rows get ``row_rngs(key_rng(seed, key), B)`` (the host
runners), or the synchronous runner's per-chunk key split the same way
(:func:`row_rngs`), so a hand loop that calls the policy the same way reproduces a
runner's samples.
"""

ValueFn = Callable[[Any, PyTree], Any]


@jax.jit
def _fold_key(seed: jax.Array, fields: jax.Array) -> jax.Array:
    rng = jax.random.PRNGKey(seed)
    for i in range(5):
        rng = jax.random.fold_in(rng, fields[i])
    return rng


def key_rng(seed: int, key: TrajectoryKey) -> jax.Array:
    """The PRNG key of a chunk: ``seed`` folded with every field of ``key`` (one device
    call, independent of arrival order). Its rows' keys are :func:`row_rngs` of it."""
    return _fold_key(np.int32(seed), np.asarray([int(v) for v in key.fields()], np.int32))


def row_rngs(rng: jax.Array, rows: int) -> jax.Array:
    """The per-row PRNG keys ``[rows, 2]`` a chunk's ``policy_fn`` call gets from the
    chunk's key ``rng``: ``jax.random.split(rng, rows)`` (every runner's rule)."""
    return jax.random.split(rng, rows)


@functools.partial(jax.jit, static_argnums=2)
def _fold_rows(seed: jax.Array, fields: jax.Array, rows: int) -> jax.Array:
    return jax.vmap(lambda f: row_rngs(_fold_key(seed, f), rows))(fields)


def key_rngs(seed: int, keys: Sequence[TrajectoryKey], rows: int) -> dict[tuple, np.ndarray]:
    """The row keys ``row_rngs(key_rng(seed, key), rows)`` of many chunks in one device
    call, as host arrays ``[rows, 2]`` by key tuple."""
    fields = np.asarray([[int(v) for v in k.fields()] for k in keys], np.int32).reshape(-1, 5)
    # Padded to a power of two: runs of different lengths share a few compiled shapes
    # (a compile costs ~0.3 s, more than a short run's collection).
    n = len(fields)
    padded = np.zeros((max(64, 1 << max(n - 1, 0).bit_length()), 5), np.int32)
    padded[:n] = fields
    rngs = np.asarray(_fold_rows(np.int32(seed), padded, int(rows)))[:n]
    return {tuple(f): r for f, r in zip(fields.tolist(), rngs)}


class StepRngs:
    """Row keys of one training step of every rank at a time (one device call when a
    step is first asked for); older steps are dropped, so memory does not grow with the
    number of steps a run collects."""

    def __init__(self, plan: TrajectoryPlan, seed: int, ranks: Sequence[int], stage_id: int):
        self.plan, self.seed, self.ranks, self.stage_id = plan, seed, list(ranks), stage_id
        self.steps: dict[int, dict] = {}

    def __call__(self, key: TrajectoryKey) -> np.ndarray:
        """``[B, 2]``: the row keys of chunk ``key``."""
        step = int(key.step_id)
        table = self.steps.get(step)
        if table is None:
            keys = [
                k
                for r in self.ranks
                for k in chunk_keys(self.plan, r, step, 1, self.stage_id)
            ]
            table = self.steps[step] = key_rngs(self.seed, keys, self.plan.batch_size)
            for old in [s for s in self.steps if s < step - 1]:
                del self.steps[old]
        return table[key.as_tuple()]


def join_rows(obs: Sequence[PyTree], rngs: Sequence[np.ndarray], slots: int) -> tuple:
    """One policy call's inputs from several chunks: observations ``[B, ...]`` and row
    keys ``[B, 2]`` concatenated in the order given, then padded to ``slots`` chunks
    with copies of the first chunk's rows (so a call always has ``slots * B`` rows: a
    jitted policy compiles once, and its numerics, which depend on the row count, are
    the same whichever chunks were ready). Returns ``(obs, rng)``."""
    pad = slots - len(obs)
    if pad < 0:
        raise ValueError(f"{len(obs)} chunks for {slots} slots")
    if slots == 1:
        return obs[0], rngs[0]
    obs = list(obs) + [obs[0]] * pad
    rngs = list(rngs) + [rngs[0]] * pad
    return jax.tree.map(lambda *xs: np.concatenate(xs), *obs), np.concatenate(rngs)


def split_rows(output: PolicyOutput, count: int, rows: int) -> list[PolicyOutput]:
    """The first ``count`` chunks' outputs (``rows`` rows each) of a joined call's
    output (host arrays, as :func:`stamp_versions` gives them); the padding's rows are
    dropped."""
    if count == 1 and np.shape(output.actions)[0] == rows:
        return [output]
    return [jax.tree.map(lambda x, j=j: x[j * rows : (j + 1) * rows], output) for j in range(count)]


def chunk_keys(
    plan: TrajectoryPlan, env_rank: int, step_id: int, num_steps: int, stage_id: int = 0
) -> list[TrajectoryKey]:
    """The keys env rank ``env_rank`` produces over ``num_steps`` steps, in order."""
    return [
        TrajectoryKey(s, e, env_rank, stage_id, t)
        for s in range(step_id, step_id + num_steps)
        for e in range(plan.num_epochs)
        for t in range(plan.num_chunks)
    ]


def env_part(
    plan: TrajectoryPlan,
    key: TrajectoryKey,
    out: EnvStep,
    prev: EnvTransition | None,
    next_obs: PyTree = None,
) -> EnvPart:
    """The env half of chunk ``key`` from what the environment returned.

    Chunk 0 of an epoch carries ``initial_transition``: the boundary flags of the
    environment's previous chunk ``prev`` (zeros before the first chunk of a run).
    With ``collect_transitions``, rows whose episode ended in the chunk take
    ``out.final_obs`` as their next observation (the state the transition led to, not
    the new episode's reset observation). ``final_values`` is the env's own, if it ran
    terminal inference; else the policy side adds it (:func:`complete_env_part`).

    Args:
      next_obs: an explicit boundary observation when ``out.next_obs`` is ``None``
        (the decoupled runner passes ``out.obs``: its next policy saw a stale one).
    """
    checked_env_step(out)
    initial = None
    if int(key.chunk_id) == 0:
        flags = prev if prev is not None else jax.tree.map(np.zeros_like, out.transition)
        initial = flags.boundary()
    override = out.next_obs if out.next_obs is not None else next_obs
    if out.next_obs is None and out.final_obs is not None and plan.collect_transitions:
        # Every row's next state: where its episode ended, the observation it ended on;
        # elsewhere final_obs is the next observation itself. (Every chunk carries it,
        # so an epoch's last chunk does too, whether or not an episode ended in it.)
        override = out.final_obs
    return EnvPart(
        source=TrajectorySource(key, plan.batch_size, 0),
        transition=out.transition,
        next_obs=override,
        initial_transition=initial,
        final_values=out.final_values,
        # Per-action observations, when the env reports them (lerobot mode keeps them
        # for its frames; the other modes drop them on arrival).
        action_obs=out.action_obs,
    )


def _ended_rows(transition: EnvTransition) -> np.ndarray | None:
    """``[B]`` bool: rows whose episode ended at any action of the chunk."""
    done = transition.resolved_dones(np)
    if done is None:
        return None
    done = np.asarray(done)
    return done.reshape(done.shape[0], -1).any(axis=1) if done.ndim > 1 else done.astype(bool)


def needs_final_values(plan: TrajectoryPlan, layout: Any, part: EnvPart) -> bool:
    """Whether the env half ``part`` must carry ``final_values``: the plan keeps values,
    and the chunk is an epoch's last (the bootstrap ``V(s_T)``) or cuts an episode under
    ``plan.truncation_bootstrap`` (``gamma * V(final obs)`` enters its reward)."""
    if layout.env.final_values is None:
        return False
    if int(part.source.key.chunk_id) == plan.num_chunks - 1:
        return True
    cut = part.transition.cut_flags(plan.truncation_bootstrap, np)
    return cut is not None and bool(np.any(cut))


def complete_env_part(
    plan: TrajectoryPlan,
    layout: Any,
    part: EnvPart,
    out: EnvStep,
    value_fn: ValueFn | None,
    params: Any,
) -> EnvPart:
    """Terminal inference on the policy side (the seed's Rollout step 5): the env half
    with ``final_values = value_fn(params, final_obs)`` where the chunk needs them
    (:func:`needs_final_values`), with the current parameters. The env worker needs no
    critic. An env half that carries its own ``final_values``, or a runner without
    ``value_fn``, is left as it is.

    ``final_obs`` is ``out.final_obs``: where an episode ended in the chunk, the
    observation it ended on; elsewhere the next observation. Rows that did not end
    take ``V(next obs)`` (only the last chunk's are read: the bootstrap ``V(s_T)``).

    Raises:
      ValueError: an episode ended in the chunk but the env gave no ``final_obs``
        (``V`` of the new episode's reset observation would be silently wrong).
    """
    if value_fn is None or part.final_values is not None:
        return part
    if not needs_final_values(plan, layout, part):
        return part
    obs = out.final_obs
    if obs is None:
        ended = _ended_rows(out.transition)
        if ended is not None and ended.any():
            raise ValueError(
                f"chunk {part.source.key.as_tuple()}: rows {np.flatnonzero(ended).tolist()} "
                "ended an episode but EnvStep.final_obs is None: terminal inference needs "
                "the observation each episode ended on"
            )
        obs = out.obs
    like = layout.env.final_values
    values = np.asarray(value_fn(params, obs), like.dtype)
    return part.replace(final_values=values.reshape(like.shape[layout.lead :]))


def check_env(env: Any, collector: TrajectoryCollector) -> None:
    """An env's spaces against the collector's examples, at a runner's construction: an
    env that offers ``check_against(policy_example)`` (the :mod:`jaxtraj.envs` adapters)
    raises ``ValueError`` naming the field and both shapes. Other envs are checked when
    their first observation arrives (:class:`ObservationCheck`)."""
    check = getattr(env, "check_against", None)
    if check is not None:
        check(policy_example_spec(collector))


def sub_env_seeds(env: Any) -> list[int] | None:
    """The seeds an env adapter gives its sub-environments, where it says: a
    ``GymnasiumEnv`` seeds sub-env ``i`` with ``seed + i``, an EnvPool pool env ``i`` with
    its ``seed + i``; ``None`` where unknown or unseeded. An env that says itself
    (``env.sub_env_seeds()``: a :class:`~jaxtraj.runners.bound.ProcessBoundEnv` reads
    them in its process) is asked."""
    own = getattr(env, "sub_env_seeds", None)
    if callable(own):
        return own()
    n = getattr(env, "num_envs", None)
    seed = getattr(env, "seed", None)
    if seed is None:  # an EnvPool pool: its config
        config = getattr(getattr(env, "pool", None), "config", None)
        seed = config.get("seed") if isinstance(config, dict) else None
    if n is None or seed is None or callable(seed):
        return None
    return [int(seed) + i for i in range(int(n))]


def check_env_ranks(collector: TrajectoryCollector, ranks: Sequence[int], stage_id: int) -> None:
    """Refuse, before any env is built, an env rank given twice or one whose
    ``(env_rank, stage_id)`` source the collector does not own (its halves would be
    refused at the first insert, after the envs were built and stepped): ``ValueError``
    naming the rank, the sources owned and the plan's ``num_env_ranks``."""
    owned = set(collector.sources)
    seen: set[int] = set()
    for rank in ranks:
        if rank in seen:
            raise ValueError(f"env rank {rank} is given twice (env_ranks {list(ranks)})")
        seen.add(rank)
        if (int(rank), int(stage_id)) not in owned:
            raise ValueError(
                f"env rank {rank} (stage {stage_id}) is not a source this collector owns "
                f"({sorted(owned)}; plan.num_env_ranks={collector.plan.num_env_ranks}): a "
                f"runner's env ranks must be among them (env ranks {list(ranks)}; by default "
                "0, 1, ... one per env, or per rank of the plan)"
            )


def check_seeds(seeds: Sequence[list[int] | None], ranks: Sequence[int]) -> None:
    """Refuse env ranks whose sub-environments share a seed (identical starting states,
    correlated data): ``ValueError`` naming the ranks and the seeds. ``seeds``: each
    rank's :func:`sub_env_seeds` (``None``: unknown).

    Pass ``allow_shared_seeds=True`` to the runner to share them on purpose."""
    owner: dict[int, int] = {}
    for own, rank in zip(seeds, ranks):
        for seed in own or ():
            if seed in owner and owner[seed] != rank:
                raise ValueError(
                    f"env ranks {owner[seed]} and {rank} both seed a sub-environment with "
                    f"{seed}: their episodes would start alike (GymnasiumEnv(seed=s) and "
                    "EnvPool seed sub-env i with s + i). Give rank r a seed B or more apart, "
                    "e.g. seed=1000 * r, or pass allow_shared_seeds=True to share them"
                )
            owner[seed] = rank


def rank_order(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Flushed ``(queue_key, item)`` pairs in a documented order: by training step, then
    epoch (pipeline micro-batches), then env rank and stage (trajectories), then queue key;
    stable otherwise."""

    def order(pair):
        key, item = pair
        scalar = lambda name: int(np.asarray(getattr(item, name, -1)).reshape(-1)[0])  # noqa: E731
        return (scalar("step_id"), scalar("epoch_id"), scalar("env_rank"), scalar("stage_id"),
                str(key))

    return sorted(items, key=order)


def stack_ranks(items: list[tuple[str, Any]]) -> Any:
    """One update's data: the items of one training step (every env rank's
    ``Trajectory``, or one Actor rank's micro-batches of several epochs), stacked on a new
    leading axis in :func:`rank_order`. ``run()``'s items of one step go in as they are::

        items = runner.run(num_steps=1)
        batch = jaxtraj.runners.service.stack_ranks(items)  # leaves [R, E, T, B, ...]
        targets = jax.vmap(lambda tr: jaxtraj.trajectory_targets(plan, tr))(batch)

    Targets are computed rank by rank (``jax.vmap`` over the new axis, as above);
    ``batch.episodes.to_list()`` lists every item's episodes, each with its index in the
    stack (``item``). In pipeline mode every Actor rank's item holds all the epoch's
    episodes: read one rank's (``item == 0``), not all.

    Raises:
      ValueError: the items mix training steps, or their structures differ.
    """
    items = rank_order(items)
    if not items:
        raise ValueError("stack_ranks: no items")
    steps = {int(np.asarray(getattr(it, "step_id", 0)).reshape(-1)[0]) for _, it in items}
    if len(steps) != 1:
        raise ValueError(
            f"stack_ranks: the items are of several training steps {sorted(steps)}: stack "
            "one step's (run(num_steps=1), or the items of one step_id)"
        )
    trees = [it for _, it in items]
    first = jax.tree.structure(trees[0])
    for (key, _), tree in zip(items, trees):
        if jax.tree.structure(tree) != first:
            raise ValueError(f"stack_ranks: item {key!r} has another structure than the first")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def policy_example_spec(collector: TrajectoryCollector) -> PolicyPart:
    """One policy half of the collector's layout, as ``jax.ShapeDtypeStruct`` leaves."""
    lay = collector.layout
    one = lambda x: jax.ShapeDtypeStruct(x.shape[lay.lead :], x.dtype)
    source = TrajectorySource(None, collector.plan.batch_size, 0)
    return PolicyPart(
        source, jax.tree.map(one, lay.policy.obs), jax.tree.map(one, lay.policy.output)
    )


def action_spec(layout: Any) -> tuple[tuple[int, ...], np.dtype]:
    """One chunk's actions as the collector's layout holds them: ``(shape, dtype)``, the
    shape ``[B, K, ...]``."""
    like = layout.policy.output.actions
    return tuple(like.shape[layout.lead :]), np.dtype(like.dtype)


def sendable_actions(output: PolicyOutput, spec: tuple, chunks: int) -> np.ndarray | None:
    """A joined call's actions as one host array, where they are what the layout holds
    for ``chunks`` chunks (rows, shape, dtype: all the structure check asks of them), so
    that they can go to the envs before the rest of the output is made into checked
    policy halves; else ``None``: the halves are checked first, and a wrong action chunk
    never reaches an env. (A half refused for another field then stops the run with its
    chunk stepped: its env half is collected, its policy half not.)"""
    actions = np.asarray(output.actions)
    shape, dtype = spec
    if actions.shape == (chunks * shape[0], *shape[1:]) and actions.dtype == dtype:
        return actions
    return None


def action_rows(layout: Any) -> tuple[tuple[int, ...], int]:
    """What a row of a policy call's actions must be under the collector's layout:
    ``(its shape, K)``."""
    like = layout.policy.output.actions
    return tuple(like.shape[layout.lead + 1 :]), layout.actions_per_chunk


def checked_policy_output(
    output: Any, rows: int, finite: bool = True, per_row: tuple | None = None
) -> PolicyOutput:
    """``policy_fn``'s return, refused unless it is a :class:`~jaxtraj.PolicyOutput` with
    a row for each of the ``rows`` it was given on every field (a call's rows: its ranks'
    ``B`` each, padded to ``max_batch * B``), actions of the layout's shape a row (where
    ``per_row``, :func:`action_rows`' ``(shape, K)``, is given) and, with ``finite``
    (the plan's ``nonfinite="reject"``), finite actions: a ``TypeError`` /
    ``ValueError`` saying what it returned, before its rows are split among the ranks
    (whose checks could only name one rank's slice) and before an env steps a NaN (whose
    rewards would then be refused, blaming the env)."""
    if not isinstance(output, PolicyOutput):
        raise TypeError(
            f"policy_fn returned a {type(output).__name__}: it must return a "
            f"jaxtraj.PolicyOutput (actions [N, K, A] for the N = {rows} rows of obs it was given)"
        )
    # (versions: the runner stamps them where the plan keeps them)
    for path, leaf in jax.tree_util.tree_flatten_with_path(output.replace(versions=None))[0]:
        shape = np.shape(leaf)
        if not shape or shape[0] != rows:
            raise ValueError(
                f"policy_fn was given {rows} rows (obs leaves [{rows}, ...], rng [{rows}, 2]) "
                f"and returned PolicyOutput{jax.tree_util.keystr(path)} of shape {shape}: "
                "every field needs a row per row given (a call serves up to max_batch "
                "ranks of B rows, padded to max_batch * B; a policy written for one rank's "
                "B rows gets more)"
            )
    if per_row is not None and tuple(np.shape(output.actions)[1:]) != per_row[0]:
        row, k = per_row
        shape = tuple(np.shape(output.actions))
        fix = (f": reshape them to {(rows, *row)}"
               if int(np.prod(shape[1:])) == int(np.prod(row)) else "")
        raise ValueError(
            f"policy_fn returned PolicyOutput.actions of shape {shape} for its {rows} rows: "
            f"each row's actions must be of shape {row} (the plan's K = {k} actions a "
            f"chunk, as the env takes them){fix}"
        )
    if not finite:
        return output
    actions = np.asarray(output.actions)
    if jnp.issubdtype(actions.dtype, jnp.inexact) and not np.isfinite(actions).all():
        bad = np.flatnonzero(~np.isfinite(actions.reshape(rows, -1)).all(axis=1))
        shown = ", ".join(str(int(r)) for r in bad[:5]) + (", ..." if bad.size > 5 else "")
        value = actions[~np.isfinite(actions)][0]
        raise ValueError(
            f"policy_fn returned non-finite actions (rows [{shown}] of {rows}: {value}); "
            "none reached an env (the plan's nonfinite='reject'; 'allow' lets them through)"
        )
    return output


def stamp_versions(output: PolicyOutput, version: int, stamp: bool = True) -> PolicyOutput:
    """``output`` as host arrays, ``versions`` set to ``version`` on every row (when the
    plan keeps versions: ``stamp``)."""
    output = jax.tree.map(np.asarray, output)
    if stamp:
        rows = np.shape(output.actions)[0]
        output = output.replace(versions=np.full((rows,), version, np.int32))
    return output


# batch_wait_s="auto": the share of a step its env spends on CPU (of the time it could run)
# from which the ranks' steps count as CPU-bound (a simulator computing, not waiting on a
# clock or I/O), and the longest wait it then sets.
AUTO_CPU_BOUND = 0.5
AUTO_WAIT_MAX_S = 0.05


def checked_batch_wait(value: Any, auto: bool) -> float | str:
    """A runner's ``batch_wait_s``: a finite number of seconds >= 0, as a float, or (where
    the runner offers it, ``auto``) ``"auto"``.

    Raises:
      ValueError: anything else (a bool, NaN, a string), naming the value.
    """
    if isinstance(value, str) and value == "auto":
        if auto:
            return value
        raise ValueError(
            "batch_wait_s='auto' is the threaded runners' (their envs report their CPU "
            "share; Ray's actors do not): give a number of seconds"
        )
    if not _is_seconds(value):
        choices = "'auto' or a finite" if auto else "a finite"
        raise ValueError(f"batch_wait_s must be {choices} number of seconds >= 0, got {value!r}")
    return float(value)


class RunGuard:
    """One ``run()`` at a time: entering while a run is under way (a ``run()`` from
    ``on_flush``, ``policy_fn`` or another thread) raises ``RuntimeError``. ``lock``
    also guards what a runner decides on whether a run is under way (``running``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = False

    def __enter__(self) -> RunGuard:
        with self.lock:
            if self.running:
                raise RuntimeError(
                    "run() is already running (called from on_flush, policy_fn or another "
                    "thread): a runner runs one run() at a time"
                )
            self.running = True
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.lock:
            self.running = False


def checked_env_step(out: Any) -> EnvStep:
    """``out`` if it is an :class:`EnvStep`.

    Raises:
      TypeError: anything else (a gymnasium step's tuple), naming its type.
    """
    if not isinstance(out, EnvStep):
        raise TypeError(f"env.step must return an EnvStep, got {type(out).__name__}")
    return out


def check_run_start(collector: TrajectoryCollector, env_ranks: Sequence[int], stage_id: int,
                    step_id: int, num_steps: int) -> None:
    """Before a run: the collector accepts the runner's next training step from every
    rank, and will flush each step the run completes (else a later step's halves could
    only be held, and lost when the run ends).

    Raises:
      ValueError: a rank's step differs (naming the rank and both steps), or
        ``auto_flush=False`` with ``num_steps > 1``; nothing has run.
    """
    for r in env_ranks:
        current = collector.current_step(r, stage_id)
        if current != step_id:
            hint = (" (auto_flush=False: flush() the complete step first)"
                    if not collector.auto_flush and current < step_id else "")
            raise ValueError(
                f"env rank {r}: the collector accepts training step {current}, the runner's "
                f"next is step {step_id}{hint}: set runner.step_id = {current} (a collector "
                "restored from a checkpoint), or give the runner a collector at its step"
            )
    if not collector.auto_flush and num_steps > 1:
        raise ValueError(
            f"num_steps={num_steps} with a collector of auto_flush=False: it flushes a step "
            "only when you call flush(), so a later step's halves could never go in; run "
            "one step at a time (num_steps=1) and flush between runs"
        )


def checked_seconds(name: str, value: Any) -> float:
    """A finite number of seconds >= 0 (``jitter_s``), as a float.

    Raises:
      ValueError: anything else (a bool, NaN, infinity, a string), naming ``name``.
    """
    if not _is_seconds(value):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _is_seconds(value: Any) -> bool:
    """A finite real number >= 0 (not a bool)."""
    return (not isinstance(value, bool) and isinstance(value, numbers.Real)
            and math.isfinite(value) and value >= 0)


def checked_num_steps(value: Any) -> int:
    """A run's ``num_steps``: an integer >= 1.

    Raises:
      ValueError: anything else (a float, a bool, 0), naming ``num_steps``; raised before
        the runner touches anything.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"num_steps must be an integer >= 1, got {value!r}")
    return int(value)


def _average(old: float | None, new: float) -> float:
    """An exponential average, each new value half the weight."""
    return new if old is None else 0.5 * (old + new)


class _Due:
    """When each env rank is expected to ask for actions next: the start of its step in
    flight plus what its steps have taken (an exponential average, each new step half
    the weight). A batched call waits (at most ``batch_wait_s``) only for the ranks
    expected within the wait: one whose step will be back later is not waited for, and
    ranks whose steps take alike fall into step with each other, served by one call.

    It also keeps what share of its steps each rank's env spent on CPU
    (:meth:`cpu`), from which ``batch_wait_s="auto"`` decides (:meth:`auto_wait`). A
    runner keeps one across its runs: what it learnt carries on, steps in flight do not
    (:meth:`new_run`)."""

    def __init__(self, n: int):
        self.start: list[float | None] = [None] * n
        self.took: list[float | None] = [None] * n
        self.share: list[float | None] = [None] * n

    def new_run(self) -> None:
        """A run starts: no step is in flight."""
        self.start = [None] * len(self.start)

    def started(self, i: int, now: float) -> None:
        self.start[i] = now

    def back(self, i: int, now: float) -> None:
        start, self.start[i] = self.start[i], None
        if start is not None:
            self.took[i] = _average(self.took[i], now - start)

    def cpu(self, i: int, share: float | None) -> None:
        """Rank ``i``'s env spent ``share`` of its last step on CPU (of the time it could
        run; ``None``: not measured)."""
        if share is not None:
            self.share[i] = _average(self.share[i], share)

    def by(self, i: int, deadline: float) -> bool:
        """Whether rank ``i`` is expected to ask by ``deadline`` (unknown: it may)."""
        start, took = self.start[i], self.took[i]
        return start is None or took is None or start + took <= deadline

    def auto_wait(self) -> float:
        """``batch_wait_s="auto"``'s wait: where the ranks' envs are CPU-bound (on average
        at least :data:`AUTO_CPU_BOUND` of a step on CPU), the longest of
        their step times (at most :data:`AUTO_WAIT_MAX_S`), so that they fall into step
        and one call serves them all: every call less is CPU the simulators get. Else 0,
        no rank waits for another (a latency-bound env leaves CPUs idle: waiting would
        only delay). 0 until both are measured."""
        shares = [x for x in self.share if x is not None]
        took = [x for x in self.took if x is not None]
        if not shares or not took or sum(shares) < AUTO_CPU_BOUND * len(shares):
            return 0.0
        return min(max(took), AUTO_WAIT_MAX_S)


class ObservationCheck:
    """Checks an environment's observations against the collector's layout, once per
    signature (structure, shapes, dtypes), so a wrong observation names the env worker
    that produced it rather than the policy half that carries it."""

    def __init__(self, collector: TrajectoryCollector):
        self.plan, self.layout = collector.plan, collector.layout
        self.seen: set = set()

    def __call__(self, obs: PyTree, key: TrajectoryKey) -> None:
        leaves, treedef = jax.tree.flatten(obs)
        sig = (treedef, *[(np.shape(x), getattr(x, "dtype", None)) for x in leaves])
        if sig in self.seen:
            return
        lay = self.layout
        rows = checks.check_payload("observation", obs, lay.policy.obs, lay.lead, key.as_tuple())
        if rows != self.plan.batch_size:
            raise CollectorError(
                key.as_tuple(),
                ErrorCode.BATCH_SIZE_MISMATCH,
                f"observation has {rows} rows, plan batch_size {self.plan.batch_size}",
            )
        self.seen.add(sig)


class Consumer:
    """The one place that touches the collector: inserts halves, delivers flushed items.

    A half of step ``s + 1`` that arrives before its source flushed step ``s`` (pipelined
    inference, or a fast worker) is held and inserted once its step is current.

    Args:
      collector: the collector to feed (not thread-safe: one consumer only).
      on_flush: ``on_flush(queue_key, item)`` per flushed item; else
        ``output_queue.put((queue_key, item))``; else the items are kept in :attr:`kept`.
      stopped: whether the run is stopping (a worker failed): a put on a full
        ``output_queue`` then gives up, the item kept in :attr:`undelivered`, instead
        of waiting for a reader forever.

    Attributes:
      undelivered: flushed items not delivered (``on_flush`` raised, or the run stopped
        while ``output_queue`` was full); the runner hands them over on its
        :class:`RunnerError`.
    """

    def __init__(
        self,
        collector: TrajectoryCollector,
        on_flush: Callable[[str, Any], None] | None = None,
        output_queue: Any = None,
        stopped: Callable[[], bool] | None = None,
    ):
        self.collector, self.on_flush, self.output_queue = collector, on_flush, output_queue
        self.stopped = stopped
        self.kept: list[tuple[str, Any]] = []
        self.held: list[tuple[str, Any]] = []
        self.undelivered: list[tuple[str, Any]] = []
        self.delivered = 0

    def consume(self, worker: str, part: Any) -> None:
        """Insert one half from ``worker``; deliver what it completed; insert the halves
        held for the step it made current.

        Raises:
          RunnerError: the collector rejected the half (nothing changed); or a flushed
            item could not be delivered (worker ``"on_flush"`` / ``"output_queue"``: that
            item and the rest of the flush are in :attr:`undelivered`; raised once the
            half and the halves held for the next step are in).
        """
        failed = self._add(worker, part)
        if failed is not None:
            raise failed

    def consume_all(self, parts: Sequence[tuple[str, Any]]) -> None:
        """:meth:`consume` each ``(worker, half)``; a flushed item not delivered fails
        once every half is in (the first such error is raised).

        Raises:
          RunnerError: as :meth:`consume` (a rejected half at once, the rest not tried).
        """
        failed = None
        for worker, part in parts:
            try:
                self.consume(worker, part)
            except RunnerError as exc:
                if not exc.delivery:
                    raise
                failed = failed or exc
        if failed is not None:
            raise failed

    def _add(self, worker: str, part: Any) -> RunnerError | None:
        """:meth:`consume`'s work: the first delivery error, returned once every half it
        could insert is in. A rejected half, or a ``BaseException``, raises at once (the
        halves not tried stay held)."""
        key = part.source.key
        try:
            current = self.collector.current_step(int(key.env_rank), int(key.stage_id))
            if int(key.step_id) > current:
                self.held.append((worker, part))
                return None
            items = self.collector.add(part)
        except CollectorError as exc:
            raise RunnerError(worker, key.as_tuple(), exc, self.delivered) from exc
        failed = None
        for n, item in enumerate(items):
            try:
                self.deliver(item)
            except BaseException as exc:
                self.undelivered.extend(items[n:])
                if not isinstance(exc, Exception):
                    raise
                sink = "on_flush" if self.on_flush is not None else "output_queue"
                failed = RunnerError(sink, None, exc, self.delivered, what=describe_item(item))
                failed.__cause__ = exc
                break
        if items and self.held:  # a step flushed: the halves held for the next go in
            held, self.held = self.held, []
            for n, (w, p) in enumerate(held):
                try:
                    again = self._add(w, p)
                except BaseException:
                    self.held.extend(held[n + 1 :])  # not lost: still held
                    raise
                failed = failed or again
        return failed

    def insert_held(self) -> None:
        """After a failure: insert the held halves whose step is current now (an
        interrupted delivery can leave them held), whatever fails on the way (the run's
        first failure is the one reported). Those of a step still ahead stay held."""
        while True:
            ready = [(w, p) for w, p in self.held if int(p.source.key.step_id)
                     <= self.collector.current_step(int(p.source.key.env_rank),
                                                    int(p.source.key.stage_id))]
            if not ready:
                return
            taken = {id(p) for _, p in ready}
            self.held = [(w, p) for w, p in self.held if id(p) not in taken]
            for w, p in ready:
                try:
                    self._add(w, p)
                except Exception:  # noqa: BLE001  (rejected: it changed nothing)
                    continue

    def failed_run(self) -> tuple[int, list[tuple[str, Any]]]:
        """A failed (or interrupted) run's hand-over: ``(items delivered, the items
        flushed and not handed over)``, the latter in flush order: those kept for
        ``run()``'s return (which it does not make; they move to :attr:`undelivered`),
        then those not delivered (on :class:`RunnerError`'s ``undelivered``, and the
        runner's: out of the collector, so only there)."""
        if self.kept:
            self.delivered -= len(self.kept)
            self.undelivered = self.kept + self.undelivered
            self.kept = []
        return self.delivered, list(self.undelivered)

    def deliver(self, item: tuple[str, Any]) -> None:
        if self.on_flush is not None:
            self.on_flush(*item)
        elif self.output_queue is not None:
            self._put(item)
        else:
            self.kept.append(item)
        self.delivered += 1

    def _put(self, item: tuple[str, Any]) -> None:
        """``output_queue.put(item)``, waiting while it is full unless the run stops."""
        if self.stopped is None:
            self.output_queue.put(item)
            return
        while True:
            try:
                self.output_queue.put(item, timeout=0.05)
                return
            except queue.Full:
                if self.stopped():
                    raise _QueueFullStopped(
                        "the run stopped while output_queue was full (nothing read it)"
                    ) from None

    def check_held(self) -> None:
        """After a run: halves still held (their step never became current) would be lost
        silently; raise instead, naming them (they stay in :attr:`held`).

        Raises:
          RunnerError: any half is held.
        """
        if self.held:
            keys = [p.source.key.as_tuple() for _, p in self.held]
            raise RunnerError(self.held[0][0], keys[0], RuntimeError(
                f"{len(keys)} half(s) of a later training step could not be inserted: their "
                f"source's step never flushed (the collector's current step is behind "
                f"them): {keys[:4]}{' ...' if len(keys) > 4 else ''}"
            ), self.delivered, self.undelivered)


class _QueueFullStopped(RuntimeError):
    """A delivery given up: the run stopped while ``output_queue`` was full."""


def describe_item(item: tuple[str, Any]) -> str:
    """``"queue 'default', step 3, env rank 1"``: what a flushed ``(queue_key, item)``
    is, for an error (the step and rank where the item carries them as scalars)."""
    queue_key, value = item
    out = f"queue {queue_key!r}"
    for name, label in (("step_id", "step"), ("env_rank", "env rank")):
        x = getattr(value, name, None)
        try:
            out += f", {label} {int(np.asarray(x).reshape(()))}"
        except (TypeError, ValueError):
            pass
    return out
