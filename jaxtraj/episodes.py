"""Episodes on device: per environment, a fixed-capacity buffer of the running
episode's frames, carried across training steps (lerobot mode).

Each flushed training step appends its frames to every environment's running
episode. An episode ends at any done, in the middle of a chunk too; the frames of
every episode that ended are emitted, and the tail of a running episode moves to the
front of the buffer and continues in the next step. ``max_len`` is the capacity: a
longer episode is an error (``overflow``), or, with ``truncate``, is cut at
``max_len`` frames and marked truncated. Nothing is ever silently overwritten.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax


@struct.dataclass
class EpisodeState:
    """Running episodes: ``frames`` leaves ``[B, L, ...]`` and ``length [B]`` int32."""

    frames: Any
    length: jax.Array


@struct.dataclass
class EpisodeBatch:
    """What one append emits, leaves ``[B, L + n, ...]`` (``n`` new frames per env).

    Attributes:
      frames: the running episode's carried frames followed by the new ones.
      episode: per position, the ordinal (per env, from 0) of the completed episode it
        belongs to; ``-1`` where the frame is not part of a completed episode.
      overflow: ``[B]`` bool, an episode longer than the capacity (without
        ``truncate``); the append must then be discarded.
    """

    frames: Any
    episode: jax.Array
    overflow: jax.Array


def init_episodes(frames_example: Any, batch_size: int, max_len: int) -> EpisodeState:
    """Empty episode buffers shaped like ``frames_example`` leaves ``[n, B, ...]``."""
    zeros = lambda x: jnp.zeros((batch_size, max_len) + x.shape[2:], x.dtype)
    return EpisodeState(
        frames=jax.tree.map(zeros, frames_example), length=jnp.zeros((batch_size,), jnp.int32)
    )


def append(
    state: EpisodeState,
    frames: Any,
    done: jax.Array,
    *,
    truncate: bool = False,
    valid: jax.Array | None = None,
) -> tuple[EpisodeState, EpisodeBatch]:
    """Append ``n`` frames per environment; emit the episodes that end.

    Args:
      state: the running episodes (capacity ``L`` frames).
      frames: new frames, leaves ``[n, B, ...]`` in time order.
      done: ``[n, B]`` bool, the episode ends after this frame.
      truncate: cut episodes at ``L`` frames (marking ``next.done`` and
        ``next.truncated`` when those features exist) instead of overflowing.
      valid: ``[n, B]`` bool, the frames that happened (an action that ran); the others
        (the slots of a chunk cut at an episode end, EnvPool's reset steps) are left out.
        ``None``: all of them.

    Returns:
      ``(state, batch)``. With ``batch.overflow`` set anywhere, keep the old state.
    """
    L = jax.tree.leaves(state.frames)[0].shape[1]

    def one(old, length, new, d, v):  # one environment: old [L, ...], new [n, ...], d [n]
        n = d.shape[0]
        # The frames that happened first, in time order (a stable sort on ~v).
        order = jnp.argsort(~v, stable=True)
        new = jax.tree.map(lambda x: x[order], new)
        d = d[order] & v[order]
        P = L + n
        i = jnp.arange(P)
        total = length + jnp.sum(v, dtype=jnp.int32)
        src = jnp.where(i < length, i, L + i - length)  # logical position -> concat(old, new)
        valid = i < total
        seq = jax.tree.map(lambda a, b: jnp.concatenate([a, b]).at[src].get(mode="clip"), old, new)
        d_seq = jnp.concatenate([jnp.zeros((L,), bool), d]).at[src].get(mode="clip") & valid

        def count(c, x):  # c: frames of the current episode before this one
            d_i, v_i = x
            forced = truncate & (c == L - 1) & ~d_i & v_i
            end = (d_i | forced) & v_i
            return jnp.where(end, 0, c + v_i.astype(jnp.int32)), (c, end, forced)

        _, (c, end, forced) = lax.scan(count, jnp.int32(0), (d_seq, valid))
        overflow = jnp.any((c >= L) & valid)
        last = jnp.max(jnp.where(end, i, -1))
        completed = (i <= last) & valid
        ordinal = jnp.cumsum(end, dtype=jnp.int32) - end.astype(jnp.int32)
        episode = jnp.where(completed, ordinal, -1)
        for key in ("next.done", "next.truncated"):
            if isinstance(seq, dict) and key in seq:
                seq[key] = seq[key] | forced.reshape(forced.shape + (1,) * (seq[key].ndim - 1))
        carry = jax.tree.map(lambda x: x.at[last + 1 + jnp.arange(L)].get(mode="clip"), seq)
        return carry, (total - last - 1).astype(jnp.int32), seq, episode, overflow

    new_b = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), frames)  # [B, n, ...]
    valid = jnp.ones(done.shape, bool) if valid is None else valid
    carry, length, seq, episode, overflow = jax.vmap(one)(
        state.frames, state.length, new_b, jnp.swapaxes(done, 0, 1), jnp.swapaxes(valid, 0, 1)
    )
    return EpisodeState(frames=carry, length=length), EpisodeBatch(seq, episode, overflow)


def completed_episodes(batch: EpisodeBatch) -> list[list[dict[str, Any]]]:
    """Per environment, its completed episodes as dicts of host arrays ``[length, ...]``.

    One device-to-host transfer per leaf of the batch, then host slicing.
    """
    frames = jax.tree.map(jax.device_get, batch.frames)
    episode = jax.device_get(batch.episode)
    out = []
    for b in range(episode.shape[0]):
        eps = []
        for k in range(int(episode[b].max()) + 1):
            rows = episode[b] == k
            eps.append({name: x[b][rows] for name, x in frames.items()})
        out.append(eps)
    return out


def running_episodes(state: EpisodeState) -> list[dict[str, Any] | None]:
    """Per environment, its running episode as a dict of host arrays ``[length, ...]``
    with its last frame marked ``next.done`` and ``next.truncated`` (when those features
    exist): the recording ended it. ``None`` where no episode is running."""
    frames = jax.tree.map(jax.device_get, state.frames)
    length = jax.device_get(state.length)
    out = []
    for b, n in enumerate(length.tolist()):
        if not n:
            out.append(None)
            continue
        ep = {name: x[b][:n].copy() for name, x in frames.items()}
        for key in ("next.done", "next.truncated"):
            if key in ep:
                ep[key][-1] = True
        out.append(ep)
    return out


def cleared(state: EpisodeState) -> EpisodeState:
    """No episode running (the buffers kept: lengths are what count)."""
    return state.replace(length=jnp.zeros_like(state.length))
