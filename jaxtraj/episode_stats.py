"""Episode statistics: the episodes that ended in a flush, from the environment's rewards.

Every rollout and pipeline flush reports the episodes that ended in it (LeRobot mode
hands over the episodes themselves, :mod:`jaxtraj.episodes`): per
episode its return (the sum of the environment's rewards, ``EnvTransition.rewards`` as the
environment gave them: no weights, no reward model, no truncation bootstrap), its length
in executed actions, whether it succeeded (any ``EnvTransition.success`` in it), and
whether it terminated or was truncated. An episode that spans training steps is counted
whole: the collector state carries each environment's running sums
(:class:`RunningEpisodes`) from one flush to the next, under ``jit`` too.

Time runs over epochs, chunks and the actions of a chunk, in that order, and only over
actions that ran (``EnvTransition.valid_actions``; under ``chunk_end="continue"`` the
actions after an end ran in the next episode and count there). A chunk-level reward
counts at the chunk's first action, a chunk-level flag at its last.

The result is fixed-shape (:class:`EpisodeStats`, one slot per action ``[E, T, B, K]``,
``ended`` marking the slots where an episode ended), so it traces; its host methods
turn it into a list of episodes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax


@struct.dataclass
class RunningEpisodes:
    """Each environment's running episode: sums so far, one array (a single buffer in the
    state, which every insert passes through).

    Attributes:
      sums: float32 ``[B, 3]`` (``[S, B, 3]`` stacked): the environment's rewards summed
        since the episode began, the actions executed since then, and how many of
        them flagged success (exact as float32 up to 2**24 actions).

    :attr:`returns`, :attr:`lengths` and :attr:`success` read them.
    """

    sums: jax.Array

    @property
    def returns(self) -> jax.Array:
        """float32 ``[B]``: the environment's rewards summed since the episode began."""
        return self.sums[..., 0]

    @property
    def lengths(self) -> jax.Array:
        """int32 ``[B]``: actions executed since the episode began."""
        return self.sums[..., 1].astype(jnp.int32)

    @property
    def success(self) -> jax.Array:
        """bool ``[B]``: a success flag was seen since the episode began."""
        return self.sums[..., 2] > 0


def init_running(batch_size: int) -> RunningEpisodes:
    """No episode under way: zeros for ``batch_size`` environments."""
    return RunningEpisodes(sums=jnp.zeros((batch_size, 3), jnp.float32))


@struct.dataclass
class EpisodeStats:
    """The episodes that ended in one flush, one slot per action: leaves ``[E, T, B, K]``
    (``K = 1`` where every field is chunk-level); a pipeline flush's are ``[S, T, B, K]``
    (its epoch, every source).

    Attributes:
      ended: bool, an episode ended at this action; the other fields hold that
        episode's figures there (zeros elsewhere).
      returns: float32, the sum of the environment's rewards over the episode.
      lengths: int32, the actions the episode executed.
      terminated, truncated: bool, how it ended.
      success: bool, a success flag anywhere in the episode.
      env_rank, stage_id: int32, the source (``[S]`` for a pipeline flush's sources).
      step_id: int32, the training step.
    """

    ended: jax.Array
    returns: jax.Array
    lengths: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    success: jax.Array
    env_rank: jax.Array
    stage_id: jax.Array
    step_id: jax.Array

    # -- traced summaries -----------------------------------------------------------------

    def count(self) -> jax.Array:
        """int32: episodes that ended."""
        return jnp.sum(self.ended, dtype=jnp.int32)

    def mean_return(self) -> jax.Array:
        """float32: their mean return (NaN when none ended)."""
        n = self.count()
        total = jnp.sum(jnp.where(self.ended, self.returns, 0.0))
        return jnp.where(n > 0, total / jnp.maximum(n, 1), jnp.nan)

    def mean_length(self) -> jax.Array:
        """float32: their mean length in actions (NaN when none ended)."""
        n = self.count()
        total = jnp.sum(jnp.where(self.ended, self.lengths, 0)).astype(jnp.float32)
        return jnp.where(n > 0, total / jnp.maximum(n, 1), jnp.nan)

    # -- host -----------------------------------------------------------------------------

    def to_list(self) -> list[dict[str, Any]]:
        """The episodes as dicts, in time order per source and row (host side): ``return``,
        ``length``, ``success``, ``terminated``, ``truncated``, ``env_rank``,
        ``stage_id``, ``row``, ``step_id`` and where it ended (``epoch`` or ``source``,
        ``chunk``, ``action``). Stacked statistics (``stack_ranks``' items, a pipeline
        flush's ``[R, S, ...]`` before it is split among the Actor ranks) list each stacked
        item's, with its index there: ``item`` (a tuple where several axes were added)."""
        host = jax.tree.map(np.asarray, self)
        ended = host.ended
        leads = ended.ndim - 3  # the axes before [T, B, K]
        per_source = host.env_rank.ndim  # the leading axes the sources' fields have
        # A flush's own axis: a trajectory's epochs (sources' fields without it), or a
        # pipeline flush's sources; any axes before it were added by stacking.
        own = "epoch" if leads > per_source else "source"
        added = leads - 1
        if not (leads == per_source + 1 or leads == per_source >= 1):
            raise ValueError(
                f"EpisodeStats.to_list: ended {ended.shape} and env_rank "
                f"{host.env_rank.shape} are no flush's (leaves [E, T, B, K] with env_rank "
                "[], or [S, T, B, K] with env_rank [S], either stacked on leading axes)"
            )
        out = []
        for at in zip(*np.nonzero(ended)):
            src = at[:per_source]
            episode = {
                "return": float(host.returns[at]),
                "length": int(host.lengths[at]),
                "success": bool(host.success[at]),
                "terminated": bool(host.terminated[at]),
                "truncated": bool(host.truncated[at]),
                "env_rank": int(host.env_rank[src]),
                "stage_id": int(host.stage_id[src]),
                "row": int(at[-2]),
                "step_id": int(host.step_id[src]),
                own: int(at[added]),
                "chunk": int(at[-3]),
                "action": int(at[-1]),
            }
            if added:
                item = tuple(int(i) for i in at[:added])
                episode["item"] = item[0] if added == 1 else item
            out.append(episode)
        order = lambda e: (e.get("item", 0), e["env_rank"], e["stage_id"], e["row"],
                           e.get("epoch", 0), e["chunk"], e["action"])
        return sorted(out, key=order)


def _per_slot(x: Any, k: int, at: int, dtype: Any, rows_ndim: int = 3) -> jax.Array:
    """``[E, T, B]`` or ``[E, T, B, K]`` -> ``[E, T, B, K]``; a chunk-level value goes to
    slot ``at`` (``-1``: the last)."""
    x = jnp.asarray(x, dtype)
    if x.ndim > rows_ndim:
        return x
    if k == 1:
        return x[..., None]
    slot = jnp.arange(k) == (at % k)  # elementwise, no scatter: it fuses
    return jnp.where(slot, x[..., None], jnp.zeros((), dtype))


def episode_stats(
    running: RunningEpisodes,
    transition: Any,
    *,
    step_id: Any,
    env_rank: Any,
    stage_id: Any,
) -> tuple[EpisodeStats, RunningEpisodes]:
    """The episodes that ended in one source's training step, and the running sums after it.

    Args:
      running: the running episodes before the step, ``[B]``.
      transition: the step's env transitions (an ``EnvTransition``), leaves
        ``[E, T, B(, K)]``, as the environment gave them.
      step_id, env_rank, stage_id: name the source and step.

    Returns:
      ``(stats, running)``: :class:`EpisodeStats` ``[E, T, B, K]``, and the running sums
      of the episodes still under way after the step.
    """
    tr = transition
    ran = tr.ran_actions(rows_ndim=3)
    k = 1 if ran is None else ran.shape[-1]
    lead = tr.rewards.shape[:3]
    ran = jnp.ones(lead + (k,), bool) if ran is None else ran
    dones = tr.resolved_dones()
    dones = jnp.zeros(lead + (k,), bool) if dones is None else _per_slot(dones, k, -1, bool)
    terms = tr.terminations
    terms = dones if terms is None else _per_slot(terms, k, -1, bool)
    truncs = tr.truncations
    truncs = jnp.zeros_like(dones) if truncs is None else _per_slot(truncs, k, -1, bool)
    success = tr.success
    success = jnp.zeros_like(dones) if success is None else _per_slot(success, k, -1, bool)
    rewards = _per_slot(tr.rewards, k, 0, jnp.float32)

    E, T, B = lead
    ET = E * T
    flat = lambda v: v.reshape((ET, B, k))  # time: over (e, t), then the chunk's actions
    ran_f = flat(ran)
    ended = flat(dones) & ran_f
    # The three sums at once, [3, ET, B, K]: rewards, executed actions, success flags.
    x = jnp.stack([jnp.where(ran_f, flat(rewards), 0.0), ran_f.astype(jnp.float32),
                   (flat(success) & ran_f).astype(jnp.float32)])

    # Sums since the episode began, by a segmented scan: an episode starts at the slot
    # after each end. Two levels (the actions of each chunk, then the chunks), so no
    # axis is moved; slots before a row's first start continue the running sums.
    def segmented(a, b):  # (reset seen, sum since the last reset), a before b
        return a[0] | b[0], jnp.where(b[0], b[1], a[1] + b[1])

    after_chunk = jnp.concatenate([jnp.zeros((1, B), bool), ended[:-1, :, -1]])
    starts = jnp.concatenate([after_chunk[..., None], ended[..., :-1]], axis=-1)[None]
    reset_k, since_k = lax.associative_scan(segmented, (starts, x), axis=3)  # in chunks
    reset_t, since_t = lax.associative_scan(
        segmented, (reset_k[..., -1], since_k[..., -1]), axis=1)  # over chunks
    reset_before = jnp.concatenate([jnp.zeros((1, 1, B), bool), reset_t[:, :-1]], axis=1)
    carried = jnp.asarray(running.sums, jnp.float32).T[:, None]  # [3, 1, B]
    since_before = jnp.concatenate([jnp.zeros_like(carried), since_t[:, :-1]], axis=1)
    since_before = since_before + jnp.where(reset_before, 0.0, carried)
    since = since_k + jnp.where(reset_k, 0.0, since_before[..., None])  # [3, ET, B, K]

    back = lambda v: v.reshape((E, T, B, k))
    zero = lambda v: back(jnp.where(ended, v, jnp.zeros_like(v)))
    stats = EpisodeStats(
        ended=back(ended),
        returns=zero(since[0]),
        lengths=zero(since[1].astype(jnp.int32)),
        terminated=back(ended & flat(terms)),
        truncated=back(ended & flat(truncs) & ~flat(terms)),
        success=back(ended & (since[2] > 0)),
        env_rank=jnp.asarray(env_rank, jnp.int32),
        stage_id=jnp.asarray(stage_id, jnp.int32),
        step_id=jnp.asarray(step_id, jnp.int32),
    )
    # After the step: the sums of the episode still under way (none if the last slot
    # ended one).
    after = RunningEpisodes(
        sums=jnp.where(ended[-1, :, -1][:, None], 0.0, since[:, -1, :, -1].T)
    )
    return stats, after
