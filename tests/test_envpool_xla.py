"""EnvPool's XLA interface in the synchronous runner (jaxtraj.envs.envpool_xla).

A collect over EnvPool Hopper-v4 equals a plain Python loop over the host API of an
identically seeded pool, field by field; the step after a done is EnvPool's reset
(reward 0, flags false) and is masked (``valid_actions`` false), within a chunk and at
action 0 of the next chunk, every other action valid, and the collector accepts it; the
driver only continues (``chunk_end="cut"`` is refused); no retrace on the second call;
every buffer stays 32-bit with ``jax_enable_x64`` on; without x64 the driver says what
to switch on.

``jax_enable_x64`` is global, so the checks run in a child process (this file run as a
script), with the suite's strict promotion flags set there too.
"""

from __future__ import annotations

import subprocess
import sys

B, K, T, E = 4, 4, 6, 2
LIMIT = 12  # truncated after 12 steps (+ 1 reset step): ends fall on every action index
GAMMA = 0.9
OBS, ACT = 11, 3


def test_envpool_collect_equals_a_host_loop_under_x64():
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for marker in (
        "without x64: clear error",
        "collect == host loop",
        "reset steps: reward 0, flags false",
        "reset steps masked",
        "cut refused",
        "no retrace",
        "buffers 32-bit under x64",
    ):
        assert marker in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------
# The child process.


def _child():
    import envpool
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")

    from jaxtraj.envs.envpool_xla import EnvPoolXla
    from jaxtraj.runners import sync

    def make_pool():
        return envpool.make(
            "Hopper-v4",
            env_type="gymnasium",
            num_envs=B,
            seed=3,
            max_episode_steps=LIMIT,
            healthy_angle_min=-0.05,  # falls over sooner: terminations within a few chunks
            healthy_angle_max=0.05,
        )

    # Without x64 the driver refuses before tracing, naming the flag.
    try:
        sync.reset(EnvPoolXla(make_pool(), K), None, jax.random.PRNGKey(0), B, K)
    except RuntimeError as e:
        assert "jax_enable_x64" in str(e), e
        print("without x64: clear error")
    else:
        raise AssertionError("no error without x64")

    try:
        EnvPoolXla(make_pool(), K, chunk_end="cut")
    except ValueError as e:
        assert "lockstep" in str(e) and "EnvPoolEnv" in str(e), e
        print("cut refused")
    else:
        raise AssertionError("chunk_end='cut' accepted")
    assert EnvPoolXla(make_pool(), K).chunk_end == "continue"

    jax.config.update("jax_enable_x64", True)
    _check_collect(make_pool)


def _check_collect(make_pool):
    import chex
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxtraj
    from jaxtraj import PolicyOutput, TrajectoryPlan
    from jaxtraj.envs.envpool_xla import EnvPoolXla
    from jaxtraj.runners import sync

    f32 = jnp.float32
    params = {
        "w": jax.random.normal(jax.random.PRNGKey(1), (OBS, K * ACT), f32),
        "v": jax.random.normal(jax.random.PRNGKey(2), (OBS,), f32),
    }

    def policy_fn(params, obs, rng):  # rng [B, 2]: a PRNG key per row
        noise = jax.vmap(lambda r: jax.random.normal(r, (K, ACT), f32))(rng)
        mean = jnp.tanh(obs @ params["w"]).reshape(noise.shape)
        # On a grid of 1/8: the host loop's actions are the same numbers, not within an ulp.
        actions = jnp.round(8 * (mean + noise)) / 8
        return PolicyOutput(
            actions=actions, prev_logprobs=-0.5 * noise**2, prev_values=obs @ params["v"]
        )

    def value_fn(params, obs):
        return obs @ params["v"]

    env = EnvPoolXla(make_pool(), K)
    plan = TrajectoryPlan(num_chunks=T, num_epochs=E, batch_size=B, gamma=GAMMA)
    counted = chex.assert_max_traces(policy_fn, n=2)  # chunk 0 and the scanned body
    pe, ve = sync.example_parts(env, None, policy_fn, value_fn, params, B, K)
    state = jaxtraj.init(plan, pe, ve)
    carry = sync.reset(env, None, jax.random.PRNGKey(7), B, K)
    rng0 = carry.rng
    collect = sync.make_collect(plan, env, None, counted, value_fn)
    state, carry = collect(state, carry, params)
    jaxtraj.raise_if_error(state)
    flush = jax.jit(jaxtraj.rollout.flush, static_argnums=0, donate_argnums=1)
    traj, state = flush(plan, state)
    traj = jax.tree.map(np.asarray, traj)

    # Every buffer and output keeps the plan's 32-bit dtypes although x64 is on.
    wide = [
        (jax.tree_util.keystr(p), x.dtype)
        for p, x in jax.tree_util.tree_leaves_with_path((state, traj, carry))
        if np.dtype(x.dtype).itemsize == 8
    ]
    assert not wide, wide
    print("buffers 32-bit under x64")

    # The host loop: an identically seeded pool, the same keys, the arrays by hand.
    pool = make_pool()
    obs = pool.reset()[0].astype(np.float32)
    pol = jax.jit(policy_fn)
    rng = rng0
    ref = {k: [] for k in ("obs", "actions", "logp", "values", "rewards", "term", "trunc")}
    ref.update(final=[], elapsed=[])
    flags = (np.zeros((B, K), bool), np.zeros((B, K), bool))
    d0 = []
    for _e in range(E):
        d0.append(flags)
        for _t in range(T):
            rng, k_pol, _k_env = jax.random.split(rng, 3)
            po = pol(params, jnp.asarray(obs), jax.random.split(k_pol, B))
            ref["obs"].append(obs)
            ref["actions"].append(np.asarray(po.actions))
            ref["logp"].append(np.asarray(po.prev_logprobs))
            ref["values"].append(np.asarray(po.prev_values))
            final, ended = obs.copy(), np.zeros(B, bool)
            rs, ts, trs, el = [], [], [], []
            for k in range(K):
                o, r, term, trunc, info = pool.step(np.asarray(po.actions[:, k], np.float64))
                obs = o.astype(np.float32)
                done = term | trunc
                first = done & ~ended  # the chunk's first end: its V bootstraps
                final[first] = obs[first]  # EnvPool: the done step gives the ending obs
                ended |= done
                rs.append(r.astype(np.float32))
                ts.append(term)
                trs.append(trunc)
                el.append(info["elapsed_step"])
            final[~ended] = obs[~ended]
            flags = (np.stack(ts, 1), np.stack(trs, 1))
            ref["rewards"].append(np.stack(rs, 1))
            ref["term"].append(flags[0])
            ref["trunc"].append(flags[1])
            ref["elapsed"].append(np.stack(el, 1))
            ref["final"].append(np.asarray(value_fn(params, jnp.asarray(final))))
    ref = {k: np.stack(v).reshape((E, T) + np.shape(v[0])) for k, v in ref.items()}
    term, trunc = ref["term"], ref["trunc"]
    assert term.any() and trunc.any(), "the test must see both kinds of ends"
    # Ends at the last action of a chunk and mid-chunk (the next action is the reset).
    done = term | trunc
    assert done[..., K - 1].any() and done[..., : K - 1].any()

    np.testing.assert_array_equal(traj.obs, ref["obs"])
    np.testing.assert_array_equal(traj.actions, ref["actions"])
    np.testing.assert_allclose(traj.prev_logprobs, ref["logp"], rtol=1e-6, atol=1e-6)
    values = np.concatenate([ref["values"], ref["final"][:, -1:]], axis=1)
    np.testing.assert_allclose(traj.prev_values, values, rtol=1e-5, atol=1e-5)
    # Raw env rewards in the state and the Trajectory; the targets' chunk rewards sum the
    # actions up to the chunk's first end and add gamma * V(final obs) if it truncated.
    np.testing.assert_array_equal(state.env.transition.rewards, ref["rewards"])
    np.testing.assert_allclose(state.env.final_values, ref["final"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(traj.rewards, ref["rewards"])
    done = term | trunc
    owned = np.cumsum(done, -1) - done == 0
    chunk = (ref["rewards"] * owned).sum(-1) + GAMMA * ref["final"] * (trunc & owned).any(-1)
    targets = jaxtraj.trajectory_targets(plan, traj)
    np.testing.assert_allclose(np.asarray(targets.rewards), chunk, rtol=1e-5, atol=1e-5)
    d0 = np.stack([np.stack(x) for x in d0])  # [E, 2, B, K]
    np.testing.assert_array_equal(traj.terminations, np.concatenate([d0[:, 0, None], term], 1))
    np.testing.assert_array_equal(traj.truncations, np.concatenate([d0[:, 1, None], trunc], 1))
    print("collect == host loop")

    # The step after a done is EnvPool's reset: reward 0, no flags, the action unused.
    flat = lambda x: np.moveaxis(x, -2, -1).reshape(-1, B)  # [E*T*K, B], time-major
    reset_step = flat(ref["elapsed"]) == 0
    after_done = np.zeros_like(reset_step)
    after_done[1:] = flat(done)[:-1]
    np.testing.assert_array_equal(reset_step, after_done)
    r = flat(np.asarray(state.env.transition.rewards))
    assert (r[reset_step] == 0).all() and not flat(done)[reset_step].any()
    print("reset steps: reward 0, flags false")

    # ... and masked: valid_actions is false exactly there (the first reset step of the
    # run follows the last chunk's flags, carried across chunks and epochs), within a
    # chunk and at action 0 of the next; the collector accepted every row (no error).
    valid = np.asarray(traj.valid_actions)  # [E, T, B, K]
    np.testing.assert_array_equal(valid, np.asarray(state.env.transition.valid_actions))
    np.testing.assert_array_equal(flat(valid), ~reset_step)
    assert (~valid[..., 1:]).any(), "a reset step within a chunk"
    assert (~valid[:, 1:, :, 0]).any(), "a reset step at action 0 of the next chunk"
    # The decision's owned actions: up to its first end, never the reset step.
    mask = np.asarray(traj.action_mask)
    assert not (mask & ~valid).any()
    np.testing.assert_array_equal(mask, valid & owned)
    print("reset steps masked")

    # A second training step: the same compiled call, the pool stepped on.
    state, carry = collect(state, carry, params)
    jaxtraj.raise_if_error(state)
    traj2, state = flush(plan, state)
    assert collect._cache_size() == 1 and int(traj2.step_id) == 1
    assert not np.array_equal(np.asarray(traj2.obs), traj.obs)
    print("no retrace")


if __name__ == "__main__":
    _child()
