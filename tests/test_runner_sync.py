"""The synchronous runner: its trajectory equals a plain Python loop over the same env
with the same keys; one compiled call per training step; no retrace on the next call.

These run chunk_end="continue" (every action runs, auto-reset inside the chunk);
tests/test_chunk_end.py checks the default, "cut"."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import jaxtraj
from jaxtraj import PolicyOutput, TrajectoryPlan
from jaxtraj.runners import sync

B, K, A, T, E = 5, 3, 2, 4, 2
GAMMA = 0.9
MODE = "continue"


@struct.dataclass
class WalkState:
    pos: jax.Array
    time: jax.Array


class RandomWalk:
    """A gymnax-style (>= 1.0) auto-resetting env: terminates when |pos| > 1.2,
    truncates after ``limit`` steps (so episodes end mid-chunk and at chunk ends)."""

    def __init__(self, limit=4, five_tuple=False):
        self.limit, self.five_tuple = limit, five_tuple

    def reset(self, key, params):
        pos = jax.random.uniform(key, (2,), minval=-0.5, maxval=0.5)
        return pos * 2.0, WalkState(pos, jnp.zeros((), jnp.int32))

    def step(self, key, state, action, params):
        k_noise, k_reset = jax.random.split(key)
        pos = state.pos + 0.3 * jnp.tanh(action) + 0.1 * jax.random.normal(k_noise, (2,))
        time = state.time + 1
        reward = -jnp.sum(pos**2) * params
        terminated = jnp.max(jnp.abs(pos)) > 1.2
        truncated = (time >= self.limit) & ~terminated
        done = terminated | truncated
        obs_st = pos * 2.0
        obs_re, state_re = self.reset(k_reset, params)
        state = jax.tree.map(lambda a, b: jnp.where(done, a, b), state_re, WalkState(pos, time))
        obs = jnp.where(done, obs_re, obs_st)
        info = {"final_observation": obs_st}
        if self.five_tuple:
            return obs, state, reward, done, info
        return obs, state, reward, terminated, truncated, info


def policy_fn(params, obs, rng):
    """``rng [B, 2]``: a PRNG key per row (the runners' policy signature)."""
    mean = jnp.tanh(obs @ params["w"]).reshape(obs.shape[0], K, A)
    noise = jax.vmap(lambda k: jax.random.normal(k, (K, A)))(rng)
    return PolicyOutput(
        actions=mean + 0.5 * noise,
        prev_logprobs=-0.5 * noise**2,
        prev_values=obs @ params["v"],
    )


def value_fn(params, obs):
    return obs @ params["v"]


PARAMS = {
    "w": jax.random.normal(jax.random.PRNGKey(1), (2, K * A)),
    "v": jnp.array([0.7, -0.4]),
}


def reference(env, env_params, params, carry, step_id=0):
    """A plain Python loop: the same keys, the arrays built by hand (numpy)."""
    rng = carry.rng
    env_state, obs = carry.env_state, carry.obs
    flags_t, flags_tr = np.zeros((B, K), bool), np.zeros((B, K), bool)
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    out = {k: [] for k in ("obs", "actions", "logp", "values", "rewards", "term", "trunc")}
    out.update(d0_term=[], d0_trunc=[], final=[])
    for _e in range(E):
        out["d0_term"].append(flags_t)
        out["d0_trunc"].append(flags_tr)
        for _t in range(T):
            rng, k_pol, k_env = jax.random.split(rng, 3)
            po = policy_fn(params, obs, jax.random.split(k_pol, B))  # row_rngs
            out["obs"].append(np.asarray(obs))
            out["actions"].append(np.asarray(po.actions))
            out["logp"].append(np.asarray(po.prev_logprobs))
            out["values"].append(np.asarray(po.prev_values))
            rs, ts, trs = [], [], []
            final = np.asarray(obs).copy()
            ended = np.zeros(B, bool)
            for k in range(K):
                keys = jax.random.split(jax.random.fold_in(k_env, k), B)
                obs, env_state, r, term, trunc, info = step(
                    keys, env_state, po.actions[:, k], env_params
                )
                done = np.asarray(term | trunc)
                first = done & ~ended  # V of the chunk's first end bootstraps it
                final[first] = np.asarray(info["final_observation"])[first]
                ended |= done
                rs.append(np.asarray(r))
                ts.append(np.asarray(term))
                trs.append(np.asarray(trunc))
            final[~ended] = np.asarray(obs)[~ended]
            flags_t, flags_tr = np.stack(ts, 1), np.stack(trs, 1)
            out["rewards"].append(np.stack(rs, 1))
            out["term"].append(flags_t)
            out["trunc"].append(flags_tr)
            out["final"].append(np.asarray(value_fn(params, jnp.asarray(final))))
    shape = lambda x: np.asarray(x).reshape((E, T) + np.shape(x[0]))
    ref = {k: shape(v) for k, v in out.items() if not k.startswith("d0")}
    ref["d0_term"], ref["d0_trunc"] = np.stack(out["d0_term"]), np.stack(out["d0_trunc"])
    return ref


def make(five_tuple=False, limit=4):
    env = RandomWalk(limit=limit, five_tuple=five_tuple)
    env_params = jnp.float32(1.0)
    plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, gamma=GAMMA)
    pe, ve = sync.example_parts(
        env, env_params, policy_fn, value_fn, PARAMS, B, K, chunk_end=MODE
    )
    state = jaxtraj.init(plan, pe, ve)
    carry = sync.reset(env, env_params, jax.random.PRNGKey(7), B, K)
    return env, env_params, plan, state, carry


@pytest.mark.parametrize("five_tuple", [False, True])
def test_trajectory_equals_a_python_loop(five_tuple):
    env, env_params, plan, state, carry = make(five_tuple)
    ref = reference(RandomWalk(), env_params, PARAMS, carry)  # same dynamics, six-tuple
    collect = sync.make_collect(plan, env, env_params, policy_fn, value_fn, chunk_end=MODE)
    state, carry2 = collect(state, carry, PARAMS)
    jaxtraj.raise_if_error(state)
    assert bool(jaxtraj.rollout.ready(state))
    traj, _ = jax.jit(jaxtraj.rollout.flush, static_argnums=0)(plan, state)

    term, trunc = ref["term"], ref["trunc"]
    if five_tuple:  # no truncation signal: every done is a termination
        term, trunc = term | trunc, np.zeros_like(trunc)
        ref["d0_term"] = ref["d0_term"] | ref["d0_trunc"]
        ref["d0_trunc"] = np.zeros_like(ref["d0_trunc"])
    assert term.any() and (five_tuple or trunc.any())  # the test exercises both
    np.testing.assert_allclose(traj.obs, ref["obs"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(traj.actions, ref["actions"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(traj.prev_logprobs, ref["logp"], rtol=1e-5, atol=1e-5)
    values = np.concatenate([ref["values"], ref["final"][:, -1:]], axis=1)
    np.testing.assert_allclose(traj.prev_values, values, rtol=1e-5, atol=1e-5)
    # The Trajectory keeps the env's rewards; the targets' chunk rewards sum the actions
    # up to the chunk's first end and bootstrap a truncation there from V(final
    # pre-reset obs); terminations never do.
    np.testing.assert_allclose(traj.rewards, ref["rewards"], rtol=1e-5, atol=1e-5)
    assert traj.valid_actions is None
    done = term | trunc
    owned = np.cumsum(done, -1) - done == 0
    cut_first = (trunc & done & owned).any(-1)
    chunk = (ref["rewards"] * owned).sum(-1) + GAMMA * ref["final"] * cut_first
    targets = jaxtraj.trajectory_targets(plan, traj)
    np.testing.assert_allclose(targets.rewards, chunk, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        traj.terminations, np.concatenate([ref["d0_term"][:, None], term], 1)
    )
    np.testing.assert_array_equal(
        traj.truncations, np.concatenate([ref["d0_trunc"][:, None], trunc], 1)
    )
    np.testing.assert_array_equal(traj.dones, traj.terminations | traj.truncations)
    np.testing.assert_array_equal(traj.step_id, 0)

    # The next training step continues the same environments: chunk 0 of step 1 starts
    # from the flags of step 0's last chunk.
    np.testing.assert_array_equal(carry2.terminations, term[-1, -1])


def test_one_compiled_call_without_retrace():
    # Traced twice per trace of the step (chunk 0 and the scanned chunk body), never again.
    counted_policy = chex.assert_max_traces(policy_fn, n=2)

    env, env_params, plan, state, carry = make()
    collect = sync.make_collect(plan, env, env_params, counted_policy, value_fn, chunk_end=MODE)
    flush = jax.jit(jaxtraj.rollout.flush, static_argnums=0, donate_argnums=1)
    steps = []
    for _ in range(3):
        state, carry = collect(state, carry, PARAMS)
        traj, state = flush(plan, state)
        steps.append(int(traj.step_id))
    jaxtraj.raise_if_error(state)
    assert steps == [0, 1, 2]  # the keys follow the collector's step
    assert collect._cache_size() == 1

    # The whole training step is one jitted program: a scan over epochs around a scan
    # over chunks, with the inserts inside.
    jaxpr = jax.make_jaxpr(
        lambda s, c: sync.collect(
            plan, env, env_params, policy_fn, value_fn, s, c, PARAMS, chunk_end=MODE
        )
    )(state, carry)
    assert [e.primitive.name for e in jaxpr.eqns].count("scan") == 1
    assert "scatter" in str(jaxpr)  # the inserts: in-place writes whose window a rejected part drops


def test_stacked_state_and_rollout_stacked_agree():
    """Into one source of a stacked (pipeline) state; the collector-free baseline
    produces the same parts."""
    env, env_params, _, _, carry = make()
    plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, num_env_ranks=2, gamma=GAMMA)
    pe, ve = sync.example_parts(
        env, env_params, policy_fn, value_fn, PARAMS, B, K, chunk_end=MODE
    )
    state = jaxtraj.init(plan, pe, ve)
    fn = jax.jit(
        lambda s, c: sync.collect(
            plan, env, env_params, policy_fn, value_fn, s, c, PARAMS, env_rank=1,
            chunk_end=MODE,
        )
    )
    state, _ = fn(state, carry)
    jaxtraj.raise_if_error(state)
    np.testing.assert_array_equal(jaxtraj.rollout.ready(state), [False, True])
    first, rest, _ = jax.jit(
        lambda c: sync.rollout_stacked(
            plan, env, env_params, policy_fn, value_fn, c, PARAMS, chunk_end=MODE
        )
    )(carry)
    np.testing.assert_allclose(state.policy.obs[1][:, 0], first[0].obs)
    np.testing.assert_allclose(state.policy.obs[1][:, 1:], rest[0].obs)
    np.testing.assert_allclose(state.env.transition.rewards[1][:, 1:], rest[1].transition.rewards)
    np.testing.assert_array_equal(first[1].source.key.chunk_id, 0)


def test_gymnax_pendulum_truncates_with_bootstrap():
    import gymnax  # a test dependency: missing, this fails rather than skips

    env, env_params = gymnax.make("Pendulum-v1")
    env_params = env_params.replace(max_steps_in_episode=6)  # episodes end mid-chunk
    k = 4

    def pol(params, obs, rng):
        return PolicyOutput(
            actions=jax.vmap(lambda r: jax.random.normal(r, (k, 1)))(rng),
            prev_logprobs=jnp.zeros((obs.shape[0], k, 1)),
            prev_values=obs[:, 0],
        )

    val = lambda params, obs: obs[:, 0] + 10.0
    plan = TrajectoryPlan(num_chunks=4, batch_size=3, gamma=1.0)
    with jax.numpy_rank_promotion("allow"):  # gymnax's Pendulum broadcasts [1] actions
        pe, ve = sync.example_parts(env, env_params, pol, val, None, 3, k, chunk_end=MODE)
        state = jaxtraj.init(plan, pe, ve)
        carry = sync.reset(env, env_params, jax.random.PRNGKey(0), 3, k)
        collect = sync.make_collect(plan, env, env_params, pol, val, chunk_end=MODE)
        state, _ = collect(state, carry, None)
        jaxtraj.raise_if_error(state)
        traj, _ = jaxtraj.rollout.flush(plan, state)
        targets = jaxtraj.trajectory_targets(plan, traj)
    trunc = np.asarray(traj.truncations[0, 1:])  # [T, B, K]
    assert not np.asarray(traj.terminations).any()
    # 16 steps, limit 6: truncated after steps 6 and 12 (chunk 1 action 1, chunk 2 action 3).
    assert trunc[1, :, 1].all() and trunc[2, :, 3].all() and trunc.sum() == 2 * 3
    # The bootstrap is V(final pre-reset obs) = cos(theta) + 10, added to the chunk's
    # reward (its actions up to the cut one, summed; gamma = 1); the Trajectory keeps the
    # env's rewards.
    raw = np.asarray(state.env.transition.rewards[0, 1])  # [B, K]
    np.testing.assert_allclose(np.asarray(traj.rewards[0, 1]), raw, rtol=1e-6)
    fv = np.asarray(state.env.final_values[0, 1])
    boot = np.asarray(targets.rewards[0, 1])
    np.testing.assert_allclose(boot, raw[:, :2].sum(-1) + fv, rtol=1e-5, atol=1e-5)
    assert (fv > 8.9).all() and (fv < 11.1).all()
