"""Pipeline mode: micro-batches per Actor rank, and the same numbers as rollout mode."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PLAN, B, E, T, all_parts, env_part, policy_part, reference

import jaxtraj
from jaxtraj import CollectorError
from jaxtraj.targets import trajectory_targets

PIPE = dataclasses.replace(PLAN, mode="pipeline", actor_ranks=2, micro_batch_size=5)
S = PIPE.num_sources


def sample_ids(mb):
    """(tag, row) of each sample: tokens hold the chunk's tag, state[0] = tag + row."""
    tag = np.asarray(mb.forward_inputs["tokens"])[..., 0]
    row = np.asarray(mb.obs["state"])[..., 0] - tag
    return tag, row.round().astype(int)


def by_epoch(out):
    """Items grouped by epoch (epochs complete, and flush, in arrival order)."""
    groups = {}
    for _, mb in out:
        groups.setdefault(int(mb.epoch_id), []).append(mb)
    return [groups[e] for e in sorted(groups)]


def collect(plan=PIPE, order_seed=0):
    c = jaxtraj.TrajectoryCollector(plan, policy_part(0), env_part(0), rng=jax.random.PRNGKey(3))
    parts = all_parts(0) + all_parts(1)
    rng = np.random.default_rng(order_seed)
    out = []
    for i in rng.permutation(len(parts)):
        out += c.add(parts[i])
    return c, out


def rollout_targets(plan):
    """Advantages the Actor computes from rollout-mode trajectories, by (tag, row)."""
    table = {}
    for r in range(S):
        tr = reference(r)
        tg = trajectory_targets(plan, tr)
        for e in range(E):
            for t in range(T):
                for b in range(B):
                    tag = 100 * r + 10 * e + t
                    table[(tag, b)] = (float(tg.advantages[e, t, b]), float(tg.returns[e, t, b]))
    return table


def test_packing_covers_every_sample_once():
    c, out = collect()
    assert [k for k, _ in out] == ["actor_0", "actor_1"] * E
    MB, M = jaxtraj.pipeline.packing(PIPE, S * T * B)
    for epoch, items in enumerate(by_epoch(out)):
        seen = []
        for mb in items:
            assert mb.actions.shape[:2] == (MB, M)
            assert mb.loss_mask.shape == (MB, M)
            assert int(mb.epoch_id) == epoch and int(mb.step_id) == 0
            tag, row = sample_ids(mb)
            mask = np.asarray(mb.loss_mask)
            seen += list(zip(tag[mask].tolist(), row[mask].tolist()))
        expect = [
            (100 * r + 10 * epoch + t, b) for r in range(S) for t in range(T) for b in range(B)
        ]
        assert sorted(seen) == sorted(expect)  # each valid sample exactly once
        assert sum(int(np.asarray(mb.loss_mask).sum()) for mb in items) == S * T * B
    assert c.current_step(0) == 1 and c.current_step(1) == 1


def test_pipeline_equals_rollout_mode_targets():
    plan = dataclasses.replace(PIPE, normalize_advantages=False)
    _, out = collect(plan)
    table = rollout_targets(plan)
    for _, mb in out:
        tag, row = sample_ids(mb)
        mask = np.asarray(mb.loss_mask)
        got_a, got_r = np.asarray(mb.advantages)[mask], np.asarray(mb.returns)[mask]
        want = np.array([table[(t, r)] for t, r in zip(tag[mask], row[mask])])
        np.testing.assert_allclose(got_a, want[:, 0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got_r, want[:, 1], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(
            got_r - got_a, np.asarray(mb.prev_values)[mask], rtol=1e-5, atol=1e-5
        )


def test_global_normalisation_over_valid_rows():
    _, out = collect()
    raw = rollout_targets(dataclasses.replace(PIPE, normalize_advantages=False))
    for items in by_epoch(out):
        a = np.concatenate([np.asarray(mb.advantages)[np.asarray(mb.loss_mask)] for mb in items])
        np.testing.assert_allclose([a.mean(), a.std()], [0.0, 1.0], atol=1e-4)
        ids = [
            (t, r)
            for mb in items
            for t, r in zip(*(x[np.asarray(mb.loss_mask)] for x in sample_ids(mb)))
        ]
        un = np.array([raw[i][0] for i in ids])
        np.testing.assert_allclose(a, (un - un.mean()) / (un.std() + 1e-8), rtol=1e-4, atol=1e-4)


def test_shuffle_depends_on_the_key_only():
    _, a = collect(order_seed=0)
    _, b = collect(order_seed=1)  # another arrival order, the same key
    for xs, ys in zip(by_epoch(a), by_epoch(b)):
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(sample_ids(x)[0], sample_ids(y)[0])


def test_incomplete_epoch_and_bad_mesh():
    c = jaxtraj.TrajectoryCollector(PIPE, policy_part(0), env_part(0))
    for p in all_parts(0):
        assert c.add(p) == []  # source 1 missing: no epoch is complete
    with pytest.raises(CollectorError, match="incomplete"):
        c.flush(0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(ValueError, match="'actor' is not an axis"):
        jaxtraj.pipeline.make_flush(PIPE, mesh, source_axis="data")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("sources", "actor"))
    odd = dataclasses.replace(PIPE, actor_ranks=3)
    jaxtraj.pipeline.make_flush(odd, mesh)  # 3 ranks over an axis of size 1 is fine


def test_stale_samples_are_masked():
    plan = dataclasses.replace(PIPE, max_staleness=1)
    c = jaxtraj.TrajectoryCollector(plan, policy_part(0), env_part(0), rng=jax.random.PRNGKey(3))
    c.current_version = 2
    parts = []
    for p in all_parts(0) + all_parts(1):
        if isinstance(p, jaxtraj.PolicyPart):  # chunk t was produced by policy version t
            t = int(p.source.key.chunk_id)
            p = p.replace(output=p.output.replace(versions=np.full((B,), t, np.int32)))
        parts.append(p)
    out = c.add_many(parts)
    for items in by_epoch(out):
        tag = np.concatenate([sample_ids(mb)[0][np.asarray(mb.loss_mask)] for mb in items])
        chunks = tag % 10
        assert sorted(set(chunks.tolist())) == [1, 2]  # version 0 is 2 behind: masked
        assert len(tag) == S * (T - 1) * B
        a = np.concatenate([np.asarray(mb.advantages)[np.asarray(mb.loss_mask)] for mb in items])
        np.testing.assert_allclose([a.mean(), a.std()], [0.0, 1.0], atol=1e-4)  # over valid rows


def _epoch_state():
    """A stacked state with every part of step 0 collected, and pipeline mode's state."""
    c = jaxtraj.TrajectoryCollector(PIPE, policy_part(0), env_part(0), auto_flush=False)
    c.add_many(all_parts(0) + all_parts(1))
    return jax.device_put(c.states[0]), jaxtraj.pipeline.init(PIPE, jax.random.PRNGKey(3))


def test_recycled_flush_equals_fresh_and_reuses_the_buffers():
    state, pipe = _epoch_state()
    flush = jaxtraj.pipeline.make_flush(PIPE, donate=False)
    fresh, _, _ = flush(state, pipe, 1)
    MB, M = jaxtraj.pipeline.packing(PIPE, S * T * B)
    assert PIPE.actor_ranks * MB * M > S * T * B  # the packing has padding places
    padding = ~np.asarray(fresh.loss_mask)
    assert padding.any() and not np.asarray(fresh.actions)[padding].any()  # zeros
    # Recycle micro-batches of another epoch, holding other samples.
    old, _, _ = flush(state, pipe, 0)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((old.obs, old.actions))]
    donated = jax.jit(
        lambda st, m, e, r: jaxtraj.pipeline.flush(PIPE, st, m, e, 0, r), donate_argnums=3
    )
    again, _, _ = donated(state, pipe, 1, old)
    chex.assert_trees_all_equal(fresh, again)
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves((again.obs, again.actions))] == (
        pointers
    )  # written in place: no fresh allocation
    with pytest.raises(ValueError, match="recycle"):
        jaxtraj.pipeline.flush(PIPE, state, pipe, 1, 0, old.replace(extras={"x": old.actions}))
    other, _, _ = flush(state, pipe, 0)
    for bad, match in (
        (other.replace(actions=other.actions.astype(np.float16)), r"recycle\['actions'\]: float16"),
        (other.replace(actions=other.actions[:1]), r"recycle\['actions'\]: float32\[1,"),
    ):
        with pytest.raises(ValueError, match=match):
            jaxtraj.pipeline.flush(PIPE, state, pipe, 1, 0, bad)


def test_row_packing_and_gather_packing_agree():
    """The CPU packer (a loop of row copies into recycled buffers) and the packer other
    backends use (one gather per leaf) produce the same micro-batches, padding included."""
    from jaxtraj.modes.pipeline import _pack_gather, _pack_rows

    rng = np.random.default_rng(0)
    N, R, MB, M = 23, 2, 3, 4  # 24 places, 1 of them padding
    place = lambda i: (i % R) * (MB * M) + i // R
    leaves = [rng.integers(0, 255, (40, 3, 2), np.uint8), rng.standard_normal((40,), np.float32)]
    rows = rng.choice(40, N, replace=False)
    order = rng.permutation(N)
    bases = [np.full((R * MB * M,) + x.shape[1:], 7, x.dtype) for x in leaves]  # stale data
    dev = jax.device_put
    by_rows = _pack_rows(N, place, dev(leaves), dev(bases), dev(rows), dev(order))
    by_gather = _pack_gather(N, place, dev(leaves), R * MB * M, dev(rows), dev(order))
    for a, b, x in zip(by_rows, by_gather, leaves):
        np.testing.assert_array_equal(a, b)
        i = np.arange(N)
        np.testing.assert_array_equal(np.asarray(a)[place(i)], x[rows[order]])
        assert not np.asarray(a)[place(N)].any()  # the padding place reads zeros


def _order_chi_square(random_bits=None, rounds=None):
    """Chi-square of the 48 orders of 6 samples (4 valid) over 4,800 fixed keys."""
    from jaxtraj.modes.pipeline import shuffle_valid_first

    valid = jnp.asarray([True, False, True, True, False, True])
    keys = jax.random.split(jax.random.PRNGKey(7), 4800)
    shuffle = jax.jit(jax.vmap(lambda k: shuffle_valid_first(k, valid, random_bits, rounds)))
    counts = {}
    for row in np.asarray(shuffle(keys)):
        assert np.asarray(valid)[row[:4]].all() and sorted(row) == list(range(6))
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    expected = 4800 / 48
    missing = 48 - len(counts)
    return sum((c - expected) ** 2 / expected for c in counts.values()) + missing * expected


@pytest.mark.parametrize("random_bits", [None, 2, 1, 0], ids=["default", "2 bits", "1 bit",
                                                              "fallback"])
def test_shuffle_is_uniform_over_orders_with_valid_samples_first(random_bits):
    """Every order of the valid samples (and of the invalid ones after them) equally likely:
    chi-square of 47 degrees of freedom under its 0.1% quantile (82.7), also with so few
    random bits a round that ties are everywhere (the rounds then make up for them)."""
    assert _order_chi_square(random_bits) < 82.7


def test_shuffle_chi_square_sees_the_bias_of_too_few_rounds():
    # With 2 random bits a round, one or two rounds leave tied samples in index order.
    assert _order_chi_square(2, 1) > 82.7 and _order_chi_square(2, 2) > 82.7


def test_shuffle_of_many_samples_is_a_permutation_with_valid_first():
    from jaxtraj.modes.pipeline import shuffle_valid_first

    valid = np.random.default_rng(3).random(8192) < 0.9
    order = np.asarray(jax.jit(shuffle_valid_first)(jax.random.PRNGKey(1), jnp.asarray(valid)))
    assert sorted(order.tolist()) == list(range(8192))
    n = int(valid.sum())
    assert valid[order[:n]].all() and not valid[order[n:]].any()
    assert abs(np.corrcoef(order[:n], np.arange(n))[0, 1]) < 0.05  # not left in index order


def numpy_per_rank(advantages, mask, eps=1e-8):
    """NumPy reference: one Actor rank's valid advantages (all its micro-batches) to mean 0,
    std 1; padding 0."""
    out = np.zeros_like(advantages)
    a = advantages[mask]
    out[mask] = (a - a.mean()) / (np.sqrt(((a - a.mean()) ** 2).mean()) + eps)
    return out


def test_per_rank_normalisation_over_each_actor_ranks_batches():
    _, raw = collect(dataclasses.replace(PIPE, normalize_advantages="none"))
    _, per_rank = collect(dataclasses.replace(PIPE, normalize_advantages="per_rank"))
    _, glob = collect(dataclasses.replace(PIPE, normalize_advantages="global"))
    assert [k for k, _ in per_rank] == [k for k, _ in raw]
    for (_, u), (_, p), (_, g) in zip(raw, per_rank, glob):
        mask = np.asarray(u.loss_mask)
        assert mask.any() and not mask.all()  # padding is excluded
        want = numpy_per_rank(np.asarray(u.advantages), mask)
        np.testing.assert_allclose(np.asarray(p.advantages), want, rtol=1e-5, atol=1e-5)
        a = np.asarray(p.advantages)[mask]  # this rank's own valid samples: mean 0, std 1
        np.testing.assert_allclose([a.mean(), a.std()], [0, 1], atol=1e-4)
        assert not np.allclose(np.asarray(p.advantages), np.asarray(g.advantages), atol=1e-3)
        # Same samples, same order: only the statistics differ from the global form.
        jax.tree.map(np.testing.assert_array_equal, p.obs, g.obs)
    with pytest.raises(ValueError, match="per_rank"):
        dataclasses.replace(PIPE, normalize_advantages="rank")
    with pytest.raises(ValueError, match="per_rank"):
        dataclasses.replace(PIPE, normalize_advantages=1)
