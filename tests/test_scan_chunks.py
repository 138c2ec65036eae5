"""Less boilerplate: one ``lax.scan`` over every chunk of an epoch, chunk zero included
(``jaxtraj.add_env_uniform``), under ``jit`` and ``vmap``; examples given as
``jax.ShapeDtypeStruct`` trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxtraj

B, T, K = 2, 4, 2
PLAN = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B, gamma=0.9)
D_BEFORE = np.array([True, False])  # chunk zero's boundary flags: read
NOT_READ = np.array([True, True])  # the other chunks' initial_transition: ignored


def halves(t, offset=0.0, uniform=True):
    """Chunk ``t``'s halves; ``t`` may be traced. A uniform env half carries
    ``initial_transition`` and ``final_values`` on every chunk."""
    t32 = jnp.asarray(t, jnp.int32)
    x = jnp.asarray(t, jnp.float32) + jnp.float32(offset)
    policy = jaxtraj.PolicyPart.at(
        chunk_id=t32, batch_size=B, obs={"state": jnp.full((B, 3), x)},
        actions=jnp.full((B, K, 1), x), prev_values=jnp.full((B,), x))
    term = (t32 == 2) & jnp.array([[False, False], [False, True]])  # env 1 ends in chunk 2
    first = jnp.where(t32 == 0, jnp.asarray(D_BEFORE), jnp.asarray(NOT_READ))
    initial = jaxtraj.EnvTransition(terminations=jnp.stack([first, first], 1),
                                    truncations=jnp.zeros((B, K), bool))
    env = jaxtraj.EnvPart.at(
        chunk_id=t32, batch_size=B, rewards=jnp.full((B, K), 1.0 + x),
        terminations=term, truncations=jnp.zeros((B, K), bool),
        initial_transition=initial if uniform else None,
        final_values=jnp.full((B,), 10.0 + x))
    return policy, env


def scan_epoch(state, offset=0.0):
    """Every chunk, chunk zero included, in one scan: no Python outside it."""

    def chunk(st, t):
        policy, env = halves(t, offset)
        st = jaxtraj.add_policy(PLAN, st, policy)
        return jaxtraj.add_env_uniform(PLAN, st, env), None

    return lax.scan(chunk, state, jnp.arange(T, dtype=jnp.int32))[0]


def reference(offset=0.0):
    """The same epoch through add_env, chunk zero peeled off by hand."""
    state = jaxtraj.init(PLAN, *halves(0, offset))
    for t in range(T):
        policy, env = halves(t, offset)
        if t:
            env = env.replace(initial_transition=None)
        state = jaxtraj.add_env(PLAN, jaxtraj.add_policy(PLAN, state, policy), env)
    jaxtraj.raise_if_error(state)
    return jaxtraj.rollout.flush(PLAN, state)[0]


def assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_one_scan_over_every_chunk_under_jit():
    state = jaxtraj.init(PLAN, *halves(0))
    state = jax.jit(scan_epoch, donate_argnums=0)(state)
    jaxtraj.raise_if_error(state)
    traj, _ = jaxtraj.rollout.flush(PLAN, state)
    dones = np.asarray(traj.dones)  # action-level: [E, T+1, B, K]
    np.testing.assert_array_equal(dones[0, 0], [[True, True], [False, False]])  # chunk zero's
    np.testing.assert_array_equal(dones[0, 1:].any(-1), [[0, 0], [0, 0], [0, 1], [0, 0]])
    assert_same(traj, reference())


def test_one_scan_over_every_chunk_under_vmap_over_sources():
    example = halves(0)
    states = jax.vmap(lambda _: jaxtraj.init(PLAN, *example))(jnp.arange(3))
    offsets = jnp.array([0.0, 100.0, 200.0], jnp.float32)
    states = jax.jit(jax.vmap(scan_epoch))(states, offsets)
    jaxtraj.raise_if_error(states)
    trajs, _ = jax.vmap(lambda st: jaxtraj.rollout.flush(PLAN, st))(states)
    for s, off in enumerate([0.0, 100.0, 200.0]):
        assert_same(jax.tree.map(lambda x, s=s: x[s], trajs), reference(off))


def test_uniform_halves_are_still_checked():
    state = jaxtraj.init(PLAN, *halves(0))
    policy, env = halves(1)
    with pytest.raises(jaxtraj.CollectorError, match="carry initial_transition on every chunk"):
        jaxtraj.add_env_uniform(PLAN, state, env.replace(initial_transition=None))
    state = jaxtraj.add_env_uniform(PLAN, state, env)
    state = jaxtraj.add_env_uniform(PLAN, state, env)  # the same half twice
    with pytest.raises(jaxtraj.CollectorError, match="DUPLICATE"):
        jaxtraj.raise_if_error(state)
    # add_env keeps its rule: initial_transition on another chunk than zero is refused
    state = jaxtraj.add_env(PLAN, jaxtraj.init(PLAN, *halves(0)), halves(1)[1])
    with pytest.raises(jaxtraj.CollectorError, match="UNEXPECTED_INITIAL_TRANSITION"):
        jaxtraj.raise_if_error(state)


def _sds(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


@pytest.mark.parametrize("storage", ["host", "device"])
def test_shape_dtype_struct_examples(storage):
    """Examples as ShapeDtypeStruct trees: nothing is read from them but shapes and dtypes."""
    f32 = np.float32
    S = jax.ShapeDtypeStruct
    flags = S((B, K), np.bool_)
    policy_example = jaxtraj.PolicyPart.at(
        chunk_id=0, obs={"state": S((B, 3), f32)}, actions=S((B, K, 1), f32),
        prev_values=S((B,), f32))
    env_example = jaxtraj.EnvPart.at(
        chunk_id=0, rewards=S((B, K), f32), terminations=flags, truncations=flags,
        initial_transition=jaxtraj.EnvTransition(terminations=flags, truncations=flags),
        final_values=S((B,), f32))
    assert policy_example.source.batch_size == B  # taken from the leaves' shapes
    state = jaxtraj.init(PLAN, policy_example, env_example)
    assert_same(_sds(state), _sds(jaxtraj.init(PLAN, *halves(0))))
    state = jax.jit(scan_epoch)(state)
    assert_same(jaxtraj.rollout.flush(PLAN, state)[0], reference())

    c = jaxtraj.TrajectoryCollector(PLAN, policy_example, env_example, storage=storage)
    out = []
    for t in range(T):
        policy, env = jax.tree.map(np.asarray, halves(t, uniform=t == 0))
        out += c.add(policy) + c.add(env)
    assert len(out) == 1
    assert_same(out[0][1], reference())
