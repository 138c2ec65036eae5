"""jaxtraj.episodes: the per-environment running-episode buffer at its capacity boundary.

An episode of exactly ``max_len`` frames fits; one of ``max_len + 1`` frames overflows without
``truncate`` and is cut at ``max_len`` frames, marked truncated, with it. Environment 0 of every
batch runs on (no done), environment 1 ends on its last frame.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtraj.episodes import append, completed_episodes, init_episodes

L = 4  # max_len
B = 2
append_jit = jax.jit(append, static_argnames="truncate")


def frames_and_done(n: int, first: int = 0):
    """``n`` frames for both environments, numbered from ``first``; env 1 is done at the last."""
    x = jnp.broadcast_to(jnp.arange(first, first + n, dtype=jnp.float32)[:, None, None], (n, B, 1))
    done = jnp.zeros((n, B), bool).at[n - 1, 1].set(True)
    frames = {
        "x": x,
        "next.done": done[:, :, None],
        "next.truncated": jnp.zeros((n, B, 1), bool),
    }
    return frames, done


def run(lengths: list[int], truncate: bool):
    """Append ``lengths`` frames in turn (env 1 done only on the very last frame)."""
    frames, _ = frames_and_done(1)
    state = init_episodes(frames, B, L)
    first, out = 0, []
    for i, n in enumerate(lengths):
        frames, done = frames_and_done(n, first)
        if i < len(lengths) - 1:
            done = jnp.zeros_like(done)
            frames["next.done"] = jnp.zeros_like(frames["next.done"])
        state, batch = append_jit(state, frames, done, truncate=truncate)
        out.append(batch)
        first += n
    return state, out


@pytest.mark.parametrize("lengths", [[L + 1], [L, 1]], ids=["one append", "carried"])
def test_one_frame_past_capacity_overflows(lengths):
    _, batches = run(lengths, truncate=False)
    assert np.asarray(batches[-1].overflow).tolist() == [True, True]


def test_one_frame_past_capacity_is_cut_with_truncate():
    state, (batch,) = run([L + 1], truncate=True)
    assert not np.asarray(batch.overflow).any()
    running, ended = completed_episodes(batch)
    # Both: the first L frames, cut and marked done and truncated on the last.
    for episodes in (running, ended):
        first = episodes[0]
        np.testing.assert_array_equal(first["x"][:, 0], np.arange(L))
        np.testing.assert_array_equal(first["next.done"][:, 0], [False] * (L - 1) + [True])
        np.testing.assert_array_equal(first["next.truncated"][:, 0], [False] * (L - 1) + [True])
    # The running episode's frame L carries on; the ended one's is an episode of its own.
    assert len(running) == 1
    assert np.asarray(state.length).tolist() == [1, 0]
    assert float(state.frames["x"][0, 0, 0]) == L
    assert len(ended) == 2
    np.testing.assert_array_equal(ended[1]["x"][:, 0], [L])
    assert ended[1]["next.done"][:, 0].tolist() == [True]
    assert ended[1]["next.truncated"][:, 0].tolist() == [False]


@pytest.mark.parametrize("lengths", [[L], [L - 1, 1]], ids=["one append", "carried"])
@pytest.mark.parametrize("truncate", [False, True])
def test_exactly_capacity_fits(lengths, truncate):
    state, batches = run(lengths, truncate=truncate)
    assert not any(np.asarray(b.overflow).any() for b in batches)
    running, ended = completed_episodes(batches[-1])
    # An episode that ends on its L-th frame is whole, not truncated.
    assert len(ended) == 1
    np.testing.assert_array_equal(ended[0]["x"][:, 0], np.arange(L))
    assert not ended[0]["next.truncated"].any()
    if truncate:
        # A running episode that fills the buffer cannot take another frame: it is cut now.
        assert len(running) == 1 and running[0]["next.truncated"][-1, 0]
        assert np.asarray(state.length).tolist() == [0, 0]
    else:
        assert running == []
        assert np.asarray(state.length).tolist() == [L, 0]
