"""chunk_end="cut" of every adapter that can cut, against hand-written single-environment
loops that stop a chunk at its first episode end and reset at the chunk's end:
GymnasiumEnv (gymnasium's InvertedPendulum-v5, SyncVectorEnv), EnvPoolEnv (EnvPool's
InvertedPendulum-v4, partial steps) and the synchronous runner over gymnax (CartPole-v1,
and a hand-written walk). Observations, actions, rewards, flags, the valid mask and
final_obs over several chunks, ends at various positions (terminations and
truncations), K in {2, 3}; the collector accepts what they produce. Also: the mode's
validation and defaults, and the first-end final_obs under "continue"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtraj
from jaxtraj import PolicyOutput, TrajectoryKey, TrajectoryPlan
from jaxtraj.envs import EnvPoolEnv, GymnasiumEnv, example_parts
from jaxtraj.runners.service import env_part

B, T, SEED, LIMIT = 3, 10, 5, 8


def pendulum_actions(n_chunks: int, k: int, batch: int = B) -> np.ndarray:
    """``[T, B, K, 1]``: env 1 pushes gently (time-limit truncations), the others push
    hard at random (terminations after a few steps): ends at every action index."""
    rng = np.random.default_rng(3)
    a = rng.uniform(-3, 3, (n_chunks, batch, k, 1))
    a[:, 1] *= 0.02
    return a.astype(np.float32)


def cut_reference(envs, first_obs, actions, info_keys=()):
    """The chunk-end rule by hand: each env steps one action at a time until its episode
    ends (that action included), executes nothing more in the chunk (slots after it:
    reward 0, flags false, invalid) and is reset (``env.reset()``, no seed) at the
    chunk's end. ``envs[i]`` has ``step(a) -> (obs, r, term, trunc, info)`` and
    ``reset() -> obs``. Returns one dict per chunk."""
    n, b_, k_ = actions.shape[:3]
    obs = [np.asarray(o, np.float32) for o in first_obs]
    chunks = []
    for t in range(n):
        out = {
            name: np.zeros((b_, k_), dtype)
            for name, dtype in (("rewards", np.float32), ("terminations", bool),
                                ("truncations", bool), ("valid", bool))
        }
        out["info"] = {name: np.zeros((b_, k_)) for name in info_keys}
        out["action_obs"] = np.zeros((b_, k_, obs[0].shape[-1]), np.float32)
        out["chunk_obs"] = np.stack(obs)
        final = [None] * b_
        for b, env in enumerate(envs):
            for k in range(k_):
                out["action_obs"][b, k] = obs[b]
                o, r, term, trunc, info = env.step(actions[t, b, k])
                obs[b] = np.asarray(o, np.float32)
                out["valid"][b, k] = True
                out["rewards"][b, k] = r
                out["terminations"][b, k], out["truncations"][b, k] = term, trunc
                for name in info_keys:
                    out["info"][name][b, k] = info.get(name, 0)
                if term or trunc:
                    final[b] = obs[b]
                    obs[b] = np.asarray(env.reset(), np.float32)  # at the chunk's end
                    break
        out["final_obs"] = np.stack([f if f is not None else o for f, o in zip(final, obs)])
        out["obs"] = np.stack(obs)
        chunks.append(out)
    return chunks


def assert_cut_step(step, ref, t, info_keys=()):
    tr = step.transition
    where = f"chunk {t}"
    np.testing.assert_array_equal(tr.valid_actions, ref["valid"], err_msg=where)
    assert tr.valid_actions.dtype == bool
    np.testing.assert_array_equal(tr.rewards, ref["rewards"], err_msg=where)
    np.testing.assert_array_equal(tr.terminations, ref["terminations"], err_msg=where)
    np.testing.assert_array_equal(tr.truncations, ref["truncations"], err_msg=where)
    np.testing.assert_array_equal(step.obs["state"], ref["obs"], err_msg=where)
    np.testing.assert_array_equal(step.final_obs["state"], ref["final_obs"], err_msg=where)
    if step.action_obs is not None:  # padding slots are not compared (they are dropped)
        got = np.asarray(step.action_obs["state"])[ref["valid"]]
        np.testing.assert_array_equal(got, ref["action_obs"][ref["valid"]], err_msg=where)
    for name in info_keys:
        np.testing.assert_array_equal(step.info[name], ref["info"][name], err_msg=name)


def assert_ends_everywhere(chunks, k):
    """The scenario has terminations and truncations, and chunks cut at every action
    index but the last (and ends at the last one)."""
    term = np.stack([c["terminations"] for c in chunks])
    trunc = np.stack([c["truncations"] for c in chunks])
    assert term.any() and trunc.any(), "both kinds of ends"
    done = term | trunc
    for j in range(k):
        assert done[..., j].any(), f"an end at action {j}"
    assert (~np.stack([c["valid"] for c in chunks])).any(), "padding"


# --------------------------------------------------------------------------- gymnasium


@pytest.fixture(scope="module")
def gym():
    return pytest.importorskip("gymnasium")


class _Single:
    """A single gymnasium env as the reference loop's env."""

    def __init__(self, env, seed):
        self.env, self.first = env, env.reset(seed=seed)[0]

    def step(self, a):
        return self.env.step(a)

    def reset(self):
        return self.env.reset()[0]


@pytest.mark.parametrize("k", [2, 3])
def test_gymnasium_cut_equals_a_single_env_loop(gym, k):
    """SyncVectorEnv (NEXT_STEP, gymnasium's default): the default chunk_end is "cut";
    the EnvSteps equal the reference's field by field, info from each sub-env's own
    step (the ending one's too), and the next chunk starts from the reset observation."""
    actions = pendulum_actions(T, k)
    singles = [
        _Single(gym.make("InvertedPendulum-v5", max_episode_steps=LIMIT), SEED + i)
        for i in range(B)
    ]
    ref = cut_reference(singles, [s.first for s in singles], actions, ("reward_survive",))
    assert_ends_everywhere(ref, k)
    vec = gym.make_vec(
        "InvertedPendulum-v5", num_envs=B, vectorization_mode="sync", max_episode_steps=LIMIT
    )
    env = GymnasiumEnv(
        vec, actions_per_chunk=k, seed=SEED, per_action_obs=True, info_keys=("reward_survive",)
    )
    assert env.chunk_end == "cut"
    first = env.reset()
    np.testing.assert_array_equal(first["state"], ref[0]["chunk_obs"])
    for t in range(T):
        step = env.step(TrajectoryKey(0, 0, 0, 0, t), actions[t])
        assert_cut_step(step, ref[t], t, ("reward_survive",))
    env.close()


class _Counter:
    """Built lazily (needs gymnasium): an env that succeeds at its 2nd step and ends at
    its ``end``-th (terminated if ``end`` is even, else truncated), reporting ``t`` and
    ``is_success`` in every step's info."""

    @staticmethod
    def make(gym, end):
        spaces = gym.spaces

        class Counter(gym.Env):
            metadata = {}
            observation_space = spaces.Box(-np.inf, np.inf, (1,), np.float64)
            action_space = spaces.Box(-1, 1, (1,), np.float32)

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                self.t = 0
                return np.zeros(1), {}

            def step(self, action):
                self.t += 1
                done = self.t >= end
                info = {"t": self.t, "is_success": self.t == 2}
                return np.full(1, self.t, float), 1.0, done and end % 2 == 0, done and end % 2 == 1, info

        return Counter


def test_gymnasium_cut_info_and_success_from_the_ending_step(gym):
    """Episodes of 2, 3 and 5 steps in chunks of 3: the info values and the success flag
    of the action that ended an episode are that step's own; padding is zero/false."""
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    ends = (2, 3, 5)
    for mode in (AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED):
        vec = SyncVectorEnv([lambda e=e: _Counter.make(gym, e)() for e in ends], autoreset_mode=mode)
        env = GymnasiumEnv(
            vec, actions_per_chunk=3, info_keys=("t",), success="is_success", obs_key="state"
        )
        env.reset()
        steps = [env.step(None, np.zeros((3, 3, 1), np.float32)) for _ in range(3)]
        valid = np.stack([s.transition.valid_actions for s in steps]).astype(int)
        np.testing.assert_array_equal(
            valid,
            [[[1, 1, 0], [1, 1, 1], [1, 1, 1]],
             [[1, 1, 0], [1, 1, 1], [1, 1, 0]],
             [[1, 1, 0], [1, 1, 1], [1, 1, 1]]],
        )
        t_info = np.stack([s.info["t"] for s in steps])
        np.testing.assert_array_equal(
            t_info,
            [[[1, 2, 0], [1, 2, 3], [1, 2, 3]],
             [[1, 2, 0], [1, 2, 3], [4, 5, 0]],
             [[1, 2, 0], [1, 2, 3], [1, 2, 3]]],
        )
        success = np.stack([s.transition.success for s in steps])
        np.testing.assert_array_equal(success, t_info == 2)
        term = np.stack([s.transition.terminations for s in steps])
        trunc = np.stack([s.transition.truncations for s in steps])
        np.testing.assert_array_equal(term[:, 0], [[0, 1, 0]] * 3)  # env 0: 2 steps
        np.testing.assert_array_equal(trunc[:, 1], [[0, 0, 1]] * 3)  # env 1: 3 steps
        np.testing.assert_array_equal(trunc[:, 2], [[0, 0, 0], [0, 1, 0], [0, 0, 0]])
        # final_obs: the ending step's observation; obs: the reset one.
        np.testing.assert_array_equal(steps[1].final_obs["state"][:, 0], [2, 3, 5])
        np.testing.assert_array_equal(steps[1].obs["state"][:, 0], [0, 0, 0])
        np.testing.assert_array_equal(steps[0].final_obs["state"][:, 0], [2, 3, 3])
        env.close()


def test_gymnasium_cut_into_a_collector(gym):
    """The user's path: example_parts carry valid_actions under cut, the collector
    accepts every chunk, and the flushed Trajectory's valid_actions / action_mask are
    the reference's valid mask."""
    k = 3
    actions = pendulum_actions(T, k)
    singles = [
        _Single(gym.make("InvertedPendulum-v5", max_episode_steps=LIMIT), SEED + i)
        for i in range(B)
    ]
    ref = cut_reference(singles, [s.first for s in singles], actions)
    vec = gym.make_vec(
        "InvertedPendulum-v5", num_envs=B, vectorization_mode="sync", max_episode_steps=LIMIT
    )
    env = GymnasiumEnv(vec, actions_per_chunk=k, seed=SEED)
    w = np.linspace(-1, 1, 4).astype(np.float32)
    plan = TrajectoryPlan(num_chunks=T, batch_size=B, gamma=0.9)
    out_example = PolicyOutput(
        actions=np.zeros((B, k, 1), np.float32), prev_values=np.zeros((B,), np.float32)
    )
    pe, ve = example_parts(env, plan, out_example)
    assert ve.transition.valid_actions.shape == (B, k)
    collector = jaxtraj.TrajectoryCollector(plan, pe, ve)
    obs, prev, items = env.reset(), None, []
    for t in range(T):
        key = TrajectoryKey(0, 0, 0, 0, t)
        src = jaxtraj.TrajectorySource(key, B, 0)
        out = PolicyOutput(actions=actions[t], prev_values=obs["state"] @ w)
        items += collector.add(jaxtraj.PolicyPart(src, obs, out))
        step = env.step(key, actions[t])
        part = env_part(plan, key, step, prev)
        items += collector.add(part.replace(final_values=step.final_obs["state"] @ w))
        obs, prev = step.obs, step.transition
    env.close()
    assert len(items) == 1
    traj = items[0][1]
    valid = np.stack([c["valid"] for c in ref])
    np.testing.assert_array_equal(np.asarray(traj.valid_actions)[0], valid)
    np.testing.assert_array_equal(np.asarray(traj.action_mask)[0], valid)
    np.testing.assert_array_equal(
        np.asarray(traj.rewards)[0], np.stack([c["rewards"] for c in ref])
    )
    np.testing.assert_array_equal(
        np.asarray(traj.obs["state"])[0], np.stack([c["chunk_obs"] for c in ref])
    )


def test_chunk_end_validation_and_defaults(gym):
    from gymnasium.vector import AsyncVectorEnv
    from gymnasium.wrappers.vector import RecordEpisodeStatistics

    make = lambda: gym.make("InvertedPendulum-v5")  # noqa: E731
    vec = gym.make_vec("InvertedPendulum-v5", num_envs=2, vectorization_mode="sync")
    with pytest.raises(ValueError, match="chunk_end must be 'cut' or 'continue', got 'stop'"):
        GymnasiumEnv(vec, actions_per_chunk=2, chunk_end="stop")
    env = GymnasiumEnv(vec, actions_per_chunk=2, chunk_end="continue")
    assert env.chunk_end == "continue" and env.spec().transition.valid_actions is None
    env = GymnasiumEnv(vec, actions_per_chunk=2)
    assert env.spec().transition.valid_actions == jax.ShapeDtypeStruct((2, 2), np.bool_)
    # A wrapped vector env would have its wrappers bypassed: continue by default.
    wrapped = RecordEpisodeStatistics(vec)
    assert GymnasiumEnv(wrapped, actions_per_chunk=2).chunk_end == "continue"
    with pytest.raises(ValueError, match="needs them in this process.*RecordEpisodeStatistics"):
        GymnasiumEnv(wrapped, actions_per_chunk=2, chunk_end="cut")
    vec.close()
    asynchronous = AsyncVectorEnv([make, make], context="spawn")
    try:
        assert GymnasiumEnv(asynchronous, actions_per_chunk=2).chunk_end == "continue"
        with pytest.raises(
            ValueError, match=r"SyncVectorEnv.*not a AsyncVectorEnv. Use chunk_end='continue'"
        ):
            GymnasiumEnv(asynchronous, actions_per_chunk=2, chunk_end="cut")
    finally:
        asynchronous.close()


def test_continue_final_obs_is_the_first_end(gym):
    """Two episode ends in one chunk under "continue": final_obs is the first one's."""
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    for mode in (AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP):
        vec = SyncVectorEnv([lambda: _Counter.make(gym, 2)()], autoreset_mode=mode)
        env = GymnasiumEnv(vec, actions_per_chunk=5, chunk_end="continue", obs_key="state")
        env.reset()
        step = env.step(None, np.zeros((1, 5, 1), np.float32))
        np.testing.assert_array_equal(step.transition.terminations, [[0, 1, 0, 1, 0]])
        assert step.transition.valid_actions is None
        assert float(step.final_obs["state"][0, 0]) == 2.0  # the end at action 1
        assert float(step.obs["state"][0, 0]) == 1.0  # the new episode's first step
        env.close()


# --------------------------------------------------------------------------- EnvPool


@pytest.fixture(scope="module")
def envpool():
    return pytest.importorskip("envpool")


class _OnePool:
    """One single-env pool (EnvPool seeds env i of a pool ``seed + i``) as the reference
    loop's env, reset through EnvPool's own autoreset: the step after a done (its
    action ignored, reward 0) gives the new episode's first observation."""

    def __init__(self, envpool, seed):
        self.pool = envpool.make(
            "InvertedPendulum-v4", env_type="gymnasium", num_envs=1, seed=seed,
            max_episode_steps=LIMIT,
        )
        self.first = self.pool.reset()[0][0]

    def step(self, a):
        o, r, te, tr, info = self.pool.step(np.asarray(a, np.float64)[None])
        return o[0], r[0], te[0], tr[0], {k: v[0] for k, v in info.items() if k != "players"}

    def reset(self):
        o, r, te, tr, info = self.step(np.zeros(1))  # EnvPool's reset step
        assert r == 0 and info["elapsed_step"] == 0 and not (te or tr)
        return o


@pytest.mark.parametrize("k", [2, 3])
def test_envpool_cut_equals_a_single_env_loop(envpool, k):
    """EnvPool's partial steps (pool.step(actions, env_id=live)) on a synchronous pool:
    the EnvSteps equal single pools stepped by hand, info included."""
    actions = pendulum_actions(T, k)
    singles = [_OnePool(envpool, SEED + i) for i in range(B)]
    ref = cut_reference(singles, [s.first for s in singles], actions, ("elapsed_step",))
    assert_ends_everywhere(ref, k)
    pool = envpool.make(
        "InvertedPendulum-v4", env_type="gymnasium", num_envs=B, seed=SEED,
        max_episode_steps=LIMIT,
    )
    env = EnvPoolEnv(pool, actions_per_chunk=k, per_action_obs=True, info_keys=("elapsed_step",))
    assert env.chunk_end == "cut"
    assert env.spec().transition.valid_actions == jax.ShapeDtypeStruct((B, k), np.bool_)
    first = env.reset()
    np.testing.assert_array_equal(first["state"], ref[0]["chunk_obs"])
    for t in range(T):
        step = env.step(TrajectoryKey(0, 0, 0, 0, t), actions[t])
        assert_cut_step(step, ref[t], t, ("elapsed_step",))
    with pytest.raises(ValueError, match="chunk_end must be 'cut' or 'continue'"):
        EnvPoolEnv(pool, actions_per_chunk=k, chunk_end=None)


# --------------------------------------------------------------------------- gymnax


def _gymnax_reference(env, env_params, policy_fn, value_fn, params, carry, n_epochs, n_chunks):
    """The synchronous runner's cut by hand: one gymnax env per row (no vmap), the
    runner's keys (policy: the batched policy on the rows' observations; action ``k`` of
    row ``b``: ``split(fold_in(k_env, k), B)[b]``); a row whose episode ended at action
    ``k`` is not stepped again in the chunk and starts the next chunk from the
    post-reset state gymnax's auto-reset gave."""
    step, policy = jax.jit(env.step), jax.jit(policy_fn)
    rng = carry.rng
    Bn = carry.obs.shape[0]
    states = [jax.tree.map(lambda x, b=b: x[b], carry.env_state) for b in range(Bn)]
    obs = [np.asarray(carry.obs[b]) for b in range(Bn)]
    chunks = []
    for _ in range(n_epochs * n_chunks):
        rng, k_pol, k_env = jax.random.split(rng, 3)
        po = policy(params, jnp.asarray(np.stack(obs)), jax.random.split(k_pol, Bn))
        actions = np.asarray(po.actions)
        Kn = actions.shape[1]
        keys = [jax.random.split(jax.random.fold_in(k_env, k), Bn) for k in range(Kn)]
        out = {
            name: np.zeros((Bn, Kn), dtype)
            for name, dtype in (("rewards", np.float32), ("terminations", bool),
                                ("truncations", bool), ("valid", bool))
        }
        out["chunk_obs"], out["actions"] = np.stack(obs), actions
        final = [None] * Bn
        for b in range(Bn):
            for k in range(Kn):
                o, states[b], r, term, trunc, info = step(
                    keys[k][b], states[b], actions[b, k], env_params
                )
                out["valid"][b, k] = True
                out["rewards"][b, k] = r
                out["terminations"][b, k], out["truncations"][b, k] = term, trunc
                obs[b] = np.asarray(o)
                if term or trunc:
                    final[b] = np.asarray(info["final_observation"])
                    break  # frozen until the chunk's end; obs and state: the reset ones
        final_obs = np.stack([f if f is not None else o for f, o in zip(final, obs)])
        out["final_values"] = np.asarray(value_fn(params, jnp.asarray(final_obs)))
        chunks.append(out)
    return chunks


@pytest.fixture
def standard_promotion():
    """gymnax's CartPole multiplies its int action with floats (the suite is strict)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _cartpole():
    gymnax = pytest.importorskip("gymnax")
    env, env_params = gymnax.make("CartPole-v1")
    return env, env_params.replace(max_steps_in_episode=11)


def _cartpole_policy(k):
    def policy_fn(params, obs, rng):  # rng [n, 2]: a PRNG key per row
        n = obs.shape[0]
        # Row b pushes right with probability 1, 0.9, 0.8, 0.5: the biased rows fall
        # (terminations at varied lengths), the fair one mostly hits the time limit.
        push = jnp.asarray([1.0, 0.9, 0.8, 0.5], jnp.float32)[:n, None]
        draws = jax.vmap(lambda r: jax.random.uniform(r, (k,)))(rng)
        actions = (draws < push).astype(jnp.int32)
        return PolicyOutput(
            actions=actions,
            prev_logprobs=jnp.zeros((n, k), jnp.float32),
            prev_values=obs @ params,
        )

    return policy_fn


@pytest.mark.parametrize("k", [2, 3])
def test_sync_runner_cut_over_gymnax_equals_a_single_env_loop(k, standard_promotion):
    """gymnax CartPole-v1 (time limit 11) through sync.make_collect with the default
    chunk_end ("cut"): observations, actions, raw rewards, flags, valid_actions and
    V(final obs) of every chunk equal the hand-written loop; the collector accepts it;
    rollout_stacked gives the same parts."""
    env, env_params = _cartpole()
    Bn, E, Tn = 4, 2, 6
    params = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
    policy_fn = _cartpole_policy(k)
    value_fn = lambda p, obs: obs @ p  # noqa: E731
    from jaxtraj.runners import sync

    plan = TrajectoryPlan(num_chunks=Tn, num_epochs=E, batch_size=Bn, gamma=0.9)
    pe, ve = sync.example_parts(env, env_params, policy_fn, value_fn, params, Bn, k)
    assert ve.transition.valid_actions.shape == (Bn, k)
    state = jaxtraj.init(plan, pe, ve)
    carry = sync.reset(env, env_params, jax.random.PRNGKey(11), Bn, k)
    ref = _gymnax_reference(env, env_params, policy_fn, value_fn, params, carry, E, Tn)
    assert_ends_everywhere(ref, k)
    collect = sync.make_collect(plan, env, env_params, policy_fn, value_fn)
    state, carry2 = collect(state, carry, params)
    jaxtraj.raise_if_error(state)
    traj, _ = jax.jit(jaxtraj.rollout.flush, static_argnums=0)(plan, state)

    stack = lambda name: np.stack([c[name] for c in ref]).reshape(  # noqa: E731
        (E, Tn) + ref[0][name].shape
    )
    np.testing.assert_array_equal(np.asarray(traj.actions), stack("actions"))
    np.testing.assert_allclose(np.asarray(traj.obs), stack("chunk_obs"), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(traj.valid_actions), stack("valid"))
    np.testing.assert_array_equal(np.asarray(traj.rewards), stack("rewards"))
    np.testing.assert_array_equal(np.asarray(traj.terminations)[:, 1:], stack("terminations"))
    np.testing.assert_array_equal(np.asarray(traj.truncations)[:, 1:], stack("truncations"))
    # V(final obs) is kept where it is read: chunks whose (first) episode end is a
    # truncation (the plan's truncation_bootstrap), and each epoch's last chunk (V(s_T)).
    used = stack("truncations").any(-1)
    used[:, -1] = True
    np.testing.assert_allclose(
        np.asarray(traj.final_values), np.where(used, stack("final_values"), 0),
        rtol=1e-5, atol=1e-5,
    )
    if k != 2:
        return
    # The collector-free baseline: the same masks.
    first, rest, _ = jax.jit(
        lambda c: sync.rollout_stacked(plan, env, env_params, policy_fn, value_fn, c, params)
    )(carry)
    np.testing.assert_array_equal(np.asarray(first[1].transition.valid_actions), stack("valid")[:, 0])
    np.testing.assert_array_equal(
        np.asarray(rest[1].transition.valid_actions), stack("valid")[:, 1:]
    )


def test_sync_runner_continue_is_unchanged_and_modes_are_checked(standard_promotion):
    """chunk_end="continue" steps every action (no valid_actions), with the same keys
    as "cut": the two agree up to each chunk's first end. A bad mode is refused."""
    from jaxtraj.runners import sync

    env, env_params = _cartpole()
    k, Bn = 3, 4
    params = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
    policy_fn, value_fn = _cartpole_policy(k), (lambda p, obs: obs @ p)
    carry = sync.reset(env, env_params, jax.random.PRNGKey(11), Bn, k)
    rows = jax.random.split(jax.random.PRNGKey(0), carry.obs.shape[0])
    actions = policy_fn(params, carry.obs, rows).actions
    rng = jax.random.PRNGKey(4)
    outs = {
        mode: sync.step_chunk(env, env_params, carry.env_state, carry.obs, actions, rng,
                              chunk_end=mode)
        for mode in ("cut", "continue")
    }
    assert len(outs["continue"]) == 6 and len(outs["cut"]) == 7
    valid = np.asarray(outs["cut"][6])
    for i in (2, 3, 4):  # rewards and flags agree where cut ran
        np.testing.assert_array_equal(
            np.asarray(outs["cut"][i])[valid], np.asarray(outs["continue"][i])[valid]
        )
    np.testing.assert_array_equal(np.asarray(outs["cut"][5]), np.asarray(outs["continue"][5]))
    plan = TrajectoryPlan(num_chunks=2, batch_size=Bn)
    pe, ve = sync.example_parts(
        env, env_params, policy_fn, value_fn, params, Bn, k, chunk_end="continue"
    )
    assert ve.transition.valid_actions is None
    state = jaxtraj.init(plan, pe, ve)
    state, _ = sync.make_collect(plan, env, env_params, policy_fn, value_fn, chunk_end="continue")(
        state, carry, params
    )
    jaxtraj.raise_if_error(state)
    with pytest.raises(ValueError, match="chunk_end must be 'cut' or 'continue', got 'cut '"):
        sync.example_parts(env, env_params, policy_fn, value_fn, params, Bn, k, chunk_end="cut ")
