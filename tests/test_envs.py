"""jaxtraj.envs against real simulators: gymnasium Hopper-v5 (sync and async vector envs,
every autoreset mode) and EnvPool Hopper-v4, field by field against hand-written loops
over single environments; casting, the spaces check, the errors, the missing extras, and
one collection into a rollout-mode TrajectoryCollector.

These run chunk_end="continue" (every action runs, an ended episode resets at once);
tests/test_chunk_end.py checks the default, "cut"."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jaxtraj
from jaxtraj import EnvTransition, PolicyOutput, TrajectoryKey, TrajectoryPlan
from jaxtraj.envs import EnvPoolEnv, EnvSpec, GymnasiumEnv, example_parts
from jaxtraj.runners.service import EnvStep, env_part

B, K, T = 3, 4, 4
SEED = 10
MODE = "continue"


def hopper_actions(t_chunks: int = T, batch: int = B, k: int = K) -> np.ndarray:
    """Actions ``[T, B, K, 3]``: env 0 falls (all -1) at chunk 1 action 1 and again at
    chunk 2 action 3; env 2 falls later; env 1 wanders."""
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (t_chunks * k, batch, 3)).astype(np.float32)
    a[:, 0] = -1.0
    if batch > 2:
        a[2:, 2] = -1.0
    return a.reshape(t_chunks, k, batch, 3).transpose(0, 2, 1, 3).copy()


def reference(makers, seeds, actions, info_keys=()):
    """Single environments, stepped one action at a time, reset by hand at once after an
    episode ends (no seed: the env's random stream continues). Returns the first
    observation and one dict per chunk, cast as the adapters cast; ``final_obs`` is
    the observation of the chunk's first episode end."""
    envs = [m() for m in makers]
    obs = [e.reset(seed=s)[0] for e, s in zip(envs, seeds)]
    first = np.asarray(obs, np.float32)
    chunks = []
    n, b_, k_ = actions.shape[:3]
    for t in range(n):
        out = {
            "rewards": np.zeros((b_, k_), np.float32),
            "terminations": np.zeros((b_, k_), bool),
            "truncations": np.zeros((b_, k_), bool),
            "action_obs": np.zeros((b_, k_, first.shape[-1]), np.float32),
            "info": {name: np.zeros((b_, k_)) for name in info_keys},
        }
        final = [None] * b_
        for b, env in enumerate(envs):
            for k in range(k_):
                out["action_obs"][b, k] = obs[b]
                o, r, term, trunc, info = env.step(actions[t, b, k])
                out["rewards"][b, k] = r
                out["terminations"][b, k], out["truncations"][b, k] = term, trunc
                for name in info_keys:
                    out["info"][name][b, k] = info[name]
                if term or trunc:
                    if final[b] is None:  # the chunk's first end
                        final[b] = o
                    o, _ = env.reset()
                obs[b] = o
        out["obs"] = np.asarray(obs, np.float32)
        out["final_obs"] = np.asarray(
            [f if f is not None else o for f, o in zip(final, obs)], np.float32
        )
        chunks.append(out)
    for e in envs:
        e.close()
    return first, chunks


def chunk_rewards(rewards, terms, truncs, v_final, gamma):
    """The chunk-end rule by hand (rewards summed): a chunk's reward is its actions'
    rewards up to and including its first episode end, plus ``gamma * V(final obs)``
    if that end is a truncation."""
    done = terms | truncs
    owned = np.cumsum(done, -1) - done == 0
    cut_first = (truncs & owned).any(-1)
    return (rewards * owned).sum(-1) + gamma * v_final * cut_first


def assert_same(step: EnvStep, ref: dict, obs_key: str = "state", info_keys=()):
    tr = step.transition
    np.testing.assert_array_equal(tr.rewards, ref["rewards"])
    assert tr.rewards.dtype == np.float32
    np.testing.assert_array_equal(tr.terminations, ref["terminations"])
    np.testing.assert_array_equal(tr.truncations, ref["truncations"])
    assert tr.terminations.dtype == bool and tr.truncations.dtype == bool
    for name, want in (("obs", step.obs), ("final_obs", step.final_obs)):
        assert set(want) == {obs_key}, name
        assert want[obs_key].dtype == np.float32, name
        np.testing.assert_array_equal(want[obs_key], ref[name], err_msg=name)
    if step.action_obs is not None:
        np.testing.assert_array_equal(step.action_obs[obs_key], ref["action_obs"])
    for name in info_keys:
        np.testing.assert_allclose(step.info[name], ref["info"][name], rtol=0, atol=0)


def run_chunks(env, actions):
    first = env.reset()
    return first, [env.step(TrajectoryKey(0, 0, 0, 0, t), actions[t]) for t in range(len(actions))]


# ----------------------------------------------------------------------- gymnasium


@pytest.fixture(scope="module")
def gym():
    return pytest.importorskip("gymnasium")


def hopper_vec(gym, mode, batch=B, max_steps=None, asynchronous=False):
    from gymnasium.vector import AsyncVectorEnv, SyncVectorEnv

    kw = {} if max_steps is None else {"max_episode_steps": max_steps}
    makers = [lambda: gym.make("Hopper-v5", **kw) for _ in range(batch)]
    if asynchronous:  # spawn: a fork of a process running JAX warns (and may deadlock)
        return AsyncVectorEnv(makers, autoreset_mode=mode, context="spawn")
    return SyncVectorEnv(makers, autoreset_mode=mode)


def test_gymnasium_matches_single_envs_every_autoreset_mode(gym):
    """Hopper-v5, an episode ending mid-chunk: SAME_STEP, NEXT_STEP and DISABLED vector
    envs give the reference loop's EnvSteps, field by field (so also each other's)."""
    from gymnasium.vector import AutoresetMode

    actions = hopper_actions()
    info_keys = ("x_position", "reward_forward")
    first, ref = reference(
        [lambda: gym.make("Hopper-v5")] * B, [SEED + i for i in range(B)], actions, info_keys
    )
    done = np.stack([c["terminations"] | c["truncations"] for c in ref])  # [T, B, K]
    assert done[..., :-1].any(), "the scenario needs an episode ending mid-chunk"
    assert done.sum() >= 3
    for mode in (AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED):
        env = GymnasiumEnv(
            hopper_vec(gym, mode),
            actions_per_chunk=K,
            seed=SEED,
            per_action_obs=True,
            info_keys=info_keys,
            chunk_end=MODE,
        )
        assert env.autoreset_mode == mode.name
        got_first, steps = run_chunks(env, actions)
        env.close()
        np.testing.assert_array_equal(got_first["state"], first)
        for t, (step, want) in enumerate(zip(steps, ref)):
            try:
                assert_same(step, want, info_keys=info_keys)
            except AssertionError as e:
                raise AssertionError(f"{mode.name}, chunk {t}: {e}") from e
            assert step.final_values is None and step.next_obs is None


def test_gymnasium_truncations_mid_chunk(gym):
    """A time limit of 3 steps with chunks of 4: truncations at every action index,
    twice in one chunk (final_obs is the first episode's), and the next chunk's first
    observation is the new episode's."""
    from gymnasium.vector import AutoresetMode

    actions = np.zeros((T, 2, K, 3), np.float32) + 0.1
    makers = [lambda: gym.make("Hopper-v5", max_episode_steps=3)] * 2
    _, ref = reference(makers, [SEED, SEED + 1], actions)
    trunc = np.stack([c["truncations"] for c in ref])
    assert trunc[2, :, 0].all() and trunc[2, :, 3].all()  # two episode ends in chunk 2
    assert not np.stack([c["terminations"] for c in ref]).any()
    for mode in (AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP):
        env = GymnasiumEnv(
            hopper_vec(gym, mode, batch=2, max_steps=3),
            actions_per_chunk=K,
            seed=SEED,
            per_action_obs=True,
            chunk_end=MODE,
        )
        _, steps = run_chunks(env, actions)
        env.close()
        for step, want in zip(steps, ref):
            assert_same(step, want)


def test_gymnasium_async_vector_env(gym):
    """AsyncVectorEnv (worker processes), NEXT_STEP: the same chunks as the reference."""
    from gymnasium.vector import AutoresetMode

    actions = hopper_actions(t_chunks=2, batch=2)
    _, ref = reference([lambda: gym.make("Hopper-v5")] * 2, [SEED, SEED + 1], actions)
    env = GymnasiumEnv(
        hopper_vec(gym, AutoresetMode.NEXT_STEP, batch=2, asynchronous=True),
        actions_per_chunk=K,
        seed=SEED,
        per_action_obs=True,
    )
    try:
        _, steps = run_chunks(env, actions)
    finally:
        env.close()
    assert np.stack([s.transition.terminations for s in steps])[..., :-1].any()
    for step, want in zip(steps, ref):
        assert_same(step, want)


def test_reset_seeds_once(gym):
    """The first reset seeds sub-env i with seed + i; a later reset continues the
    random streams (a new initial state), as gymnasium's own reset(seed=None) does."""
    from gymnasium.vector import AutoresetMode

    env = GymnasiumEnv(
        hopper_vec(gym, AutoresetMode.NEXT_STEP, batch=2),
        actions_per_chunk=2,
        seed=SEED,
        obs_key=None,
    )
    first = env.reset()
    single = gym.make("Hopper-v5")
    a, _ = single.reset(seed=SEED + 1)
    b, _ = single.reset()
    np.testing.assert_array_equal(first[1], a.astype(np.float32))
    np.testing.assert_array_equal(env.reset()[1], b.astype(np.float32))
    env.close()


class _Tiny:
    """Built lazily (needs gymnasium): a Dict-observation env with float64 state, a uint8
    image and values chosen to test casting (NaN, beyond float32)."""

    @staticmethod
    def make(gym, reward=1.0, state=0.5):
        spaces = gym.spaces

        class Tiny(gym.Env):
            metadata = {}
            observation_space = spaces.Dict(
                {
                    "state": spaces.Box(-np.inf, np.inf, (2,), np.float64),
                    "image": spaces.Box(0, 255, (2, 2, 3), np.uint8),
                }
            )
            action_space = spaces.Box(-1, 1, (1,), np.float64)

            def obs(self):
                return {
                    "state": np.full((2,), state, np.float64),
                    "image": np.full((2, 2, 3), 200, np.uint8),
                }

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                self.t = 0
                return self.obs(), {}

            def step(self, action):
                assert action.dtype == np.float64, action.dtype
                self.t += 1
                return self.obs(), reward, False, self.t >= 3, {"is_success": self.t == 2}

        return Tiny


def test_casting_dict_obs_nan_and_float64(gym):
    """Float leaves to obs_dtype, uint8 images kept, rewards to reward_dtype, actions to
    the space's float64; NaN stays NaN and a float64 beyond float32 becomes inf
    (no warning, no silent replacement); a bool info key keeps its dtype."""
    from gymnasium.vector import SyncVectorEnv

    Tiny = _Tiny.make(gym, reward=float("nan"), state=1e300)
    env = GymnasiumEnv(
        SyncVectorEnv([Tiny, Tiny]),
        actions_per_chunk=4,
        seed=0,
        info_keys=("is_success", "missing"),
        per_action_obs=True,
        chunk_end=MODE,
    )
    spec = env.spec()
    assert spec.obs["state"] == jax.ShapeDtypeStruct((2, 2), np.float32)
    assert spec.obs["image"] == jax.ShapeDtypeStruct((2, 2, 2, 3), np.uint8)
    assert spec.actions == jax.ShapeDtypeStruct((2, 4, 1), np.float64)
    obs = env.reset()
    assert obs["state"].dtype == np.float32 and np.isposinf(obs["state"]).all()
    assert obs["image"].dtype == np.uint8 and (obs["image"] == 200).all()
    step = env.step(TrajectoryKey(0, 0, 0, 0, 0), np.zeros((2, 4, 1), np.float32))
    assert step.transition.rewards.dtype == np.float32
    assert np.isnan(step.transition.rewards).all()
    np.testing.assert_array_equal(step.transition.truncations[0], [False, False, True, False])
    assert step.action_obs["image"].shape == (2, 4, 2, 2, 3)
    assert step.action_obs["image"].dtype == np.uint8
    assert step.info["is_success"].dtype == bool
    np.testing.assert_array_equal(step.info["is_success"][0], [False, True, False, False])
    assert step.info["missing"].dtype == np.float32 and not step.info["missing"].any()
    env.close()

    env = GymnasiumEnv(
        SyncVectorEnv([Tiny]), actions_per_chunk=1, obs_dtype=np.float64, reward_dtype=np.float64
    )
    assert env.reset()["state"].dtype == np.float64 and env.reset()["state"][0, 0] == 1e300
    assert env.step(None, np.zeros((1, 1, 1))).transition.rewards.dtype == np.float64


def test_spec_and_example_parts_build_a_collector(gym):
    from gymnasium.vector import AutoresetMode

    env = GymnasiumEnv(hopper_vec(gym, AutoresetMode.SAME_STEP, batch=2), actions_per_chunk=K)
    spec = env.spec()
    assert isinstance(spec, EnvSpec)
    assert spec.obs == {"state": jax.ShapeDtypeStruct((2, 11), np.float32)}
    assert spec.actions == jax.ShapeDtypeStruct((2, K, 3), np.float32)
    assert spec.transition.rewards == jax.ShapeDtypeStruct((2, K), np.float32)
    assert spec.action_obs is None
    plan = TrajectoryPlan(num_chunks=2, batch_size=2, gamma=0.9)
    out = PolicyOutput(
        actions=jax.ShapeDtypeStruct((2, K, 3), np.float32),
        prev_logprobs=jax.ShapeDtypeStruct((2, K, 3), np.float32),
        prev_values=jax.ShapeDtypeStruct((2,), np.float32),
    )
    pol, envp = example_parts(env, plan, out)
    assert pol.obs["state"].shape == (2, 11) and envp.final_values.shape == (2,)
    assert envp.initial_transition.terminations.shape == (2, K)
    collector = jaxtraj.TrajectoryCollector(plan, pol, envp)
    env.check_against(collector)
    env.check_against(pol)
    env.check_against((pol, envp))
    with pytest.raises(ValueError, match="batch_size"):
        example_parts(env, TrajectoryPlan(num_chunks=2, batch_size=3), out)
    with pytest.raises(ValueError, match=r"actions: env takes \(2, 4, 3\).*the example policy "
                       r"output \(example_parts', or the collector's\) has \(2, 12\) float32: "
                       r"reshape the policy's actions to \[N, 4, 3\]"):
        example_parts(env, plan, out.replace(actions=jax.ShapeDtypeStruct((2, 12), np.float32)))
    env.close()


def test_spaces_mismatch_names_field_and_shapes(gym):
    """A Hopper (11 observations) against a collector built for 17: the error names the
    field and both shapes and dtypes, at construction."""
    from gymnasium.vector import AutoresetMode

    plan = TrajectoryPlan(num_chunks=2, batch_size=2)
    key = TrajectoryKey(0, 0, 0, 0, 0)
    src = jaxtraj.TrajectorySource(key, 2, 0)
    pol = jaxtraj.PolicyPart(
        src,
        {"state": np.zeros((2, 17), np.float32)},
        PolicyOutput(actions=np.zeros((2, K, 3), np.float32)),
    )
    z = np.zeros((2, K), bool)
    tr = EnvTransition(rewards=np.zeros((2, K), np.float32), terminations=z, truncations=z)
    collector = jaxtraj.TrajectoryCollector(
        plan, pol, jaxtraj.EnvPart(src, tr, initial_transition=tr.boundary())
    )
    vec = hopper_vec(gym, AutoresetMode.SAME_STEP, batch=2)
    msg = (
        "observation 'state': env gives (2, 11) float32, the collector's example has "
        "(2, 17) float32"
    )
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        GymnasiumEnv(vec, actions_per_chunk=K, policy_example=collector)
    env = GymnasiumEnv(vec, actions_per_chunk=K)
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        env.check_against(pol)
    with pytest.raises(
        ValueError,
        match=r"observation: env gives \['state'\], the collector's example has \['pos'\]",
    ):
        env.check_against(pol.replace(obs={"pos": np.zeros((2, 11), np.float32)}))
    ok = pol.replace(obs={"state": np.zeros((2, 11), np.float32)})
    env.check_against(ok)
    with pytest.raises(
        ValueError, match=r"actions: env takes \(2, 4, 3\).*has \(2, 4, 2\) float32"
    ):
        env.check_against(ok.replace(output=PolicyOutput(actions=np.zeros((2, K, 2), np.float32))))
    with pytest.raises(
        ValueError,
        match=r"rewards: env gives \(2, 4\) float32, the collector's example has \(2,\) float32",
    ):
        env.check_against(
            (
                ok,
                jaxtraj.EnvPart(
                    src,
                    EnvTransition(
                        rewards=np.zeros((2,), np.float32), terminations=z, truncations=z
                    ),
                ),
            )
        )
    with pytest.raises(ValueError, match=r"actions: env takes \(2, 4, 3\).*got \(2, 3, 3\)"):
        env.reset()
        env.step(key, np.zeros((2, 3, 3)))
    env.close()


def test_unservable_autoreset_mode(gym):
    from gymnasium.vector import SyncVectorEnv

    vec = SyncVectorEnv([lambda: gym.make("Hopper-v5")])
    vec.metadata = {**vec.metadata, "autoreset_mode": "EveryOtherStep"}
    with pytest.raises(
        ValueError,
        match="'EveryOtherStep' cannot be served; served: SAME_STEP, NEXT_STEP and DISABLED",
    ):
        GymnasiumEnv(vec, actions_per_chunk=2)
    with pytest.raises(TypeError, match="VectorEnv"):
        GymnasiumEnv(gym.make("Hopper-v5"), actions_per_chunk=2)
    vec.close()


def test_gymnasium_without_reset_mask_is_refused(gym, monkeypatch):
    """gymnasium 1.0 (NEXT_STEP only, no reset_mask) cannot give same-step chunks."""
    from gymnasium.vector import SyncVectorEnv

    vec = SyncVectorEnv([lambda: gym.make("Hopper-v5")])
    monkeypatch.setattr(gym, "__version__", "1.0.0")
    with pytest.raises(
        ValueError,
        match=r"autoreset mode NEXT_STEP of gymnasium 1.0.0 cannot be served.*served: SAME_STEP, NEXT_STEP and DISABLED \(gymnasium >= 1.1\)",
    ):
        GymnasiumEnv(vec, actions_per_chunk=2)
    vec.close()


# ----------------------------------------------------------------------- EnvPool


@pytest.fixture(scope="module")
def envpool():
    return pytest.importorskip("envpool")


def envpool_reference(envpool, seeds, actions, max_steps=None):
    """One single-env pool per environment (EnvPool seeds env i of a pool ``seed + i``),
    stepped with EnvPool's own NEXT_STEP autoreset: after an episode ends, one reset
    step (its action ignored, reward 0) gives the new episode's first observation."""
    kw = {} if max_steps is None else {"max_episode_steps": max_steps}

    class One:
        def __init__(self, seed):
            self.pool = envpool.make("Hopper-v4", env_type="gymnasium", num_envs=1, seed=seed, **kw)

        def reset(self, seed=None):
            o, _ = self.pool.reset()
            return o[0], {}

        def step(self, a):
            o, r, te, tr, info = self.pool.step(np.asarray(a, np.float64)[None])
            return o[0], r[0], te[0], tr[0], {k: v[0] for k, v in info.items() if k != "players"}

        def close(self):
            pass

    class AutoReset(One):
        def reset(self, seed=None):
            if not hasattr(self, "started"):
                self.started = True
                return super().reset()
            o, r, te, tr, info = super().step(np.zeros(3))  # EnvPool's reset step
            assert r == 0 and info["elapsed_step"] == 0 and not (te or tr)
            return o, {}

    return reference([lambda s=s: AutoReset(s) for s in seeds], seeds, actions)


def test_envpool_matches_single_pools(envpool):
    """Hopper-v4 pool: the adapter's same-step resets (pool.reset(ids) after the done
    step) give what single pools with EnvPool's own autoreset give, without losing the
    action after a done to a reset step."""
    actions = hopper_actions()
    first, ref = envpool_reference(envpool, [SEED + i for i in range(B)], actions)
    assert np.stack([c["terminations"] for c in ref])[..., :-1].any()
    pool = envpool.make("Hopper-v4", env_type="gymnasium", num_envs=B, seed=SEED)
    env = EnvPoolEnv(
        pool, actions_per_chunk=K, per_action_obs=True, info_keys=("x_position",), chunk_end=MODE
    )
    assert env.spec().actions == jax.ShapeDtypeStruct((B, K, 3), np.float64)
    got_first, steps = run_chunks(env, actions)
    np.testing.assert_array_equal(got_first["state"], first)
    for t, (step, want) in enumerate(zip(steps, ref)):
        try:
            assert_same(step, want)
        except AssertionError as e:
            raise AssertionError(f"chunk {t}: {e}") from e
        assert step.info["x_position"].shape == (B, K)
    env.close()


def test_envpool_truncations_mid_chunk(envpool):
    actions = np.zeros((T, 2, K, 3), np.float32) + 0.1
    _, ref = envpool_reference(envpool, [SEED, SEED + 1], actions, max_steps=3)
    assert np.stack([c["truncations"] for c in ref])[2, :, 0].all()
    pool = envpool.make(
        "Hopper-v4", env_type="gymnasium", num_envs=2, seed=SEED, max_episode_steps=3
    )
    env = EnvPoolEnv(pool, actions_per_chunk=K, chunk_end=MODE)
    _, steps = run_chunks(env, actions)
    for step, want in zip(steps, ref):
        assert_same(step, want)


def test_envpool_refuses_async_pools_and_mismatched_spaces(envpool):
    pool = envpool.make("Hopper-v4", env_type="gymnasium", num_envs=4, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="batch_size 2, num_envs 4"):
        EnvPoolEnv(pool, actions_per_chunk=K)
    pool = envpool.make("Hopper-v4", env_type="gymnasium", num_envs=2, seed=0)
    src = jaxtraj.TrajectorySource(TrajectoryKey(0, 0, 0, 0, 0), 2, 0)
    pol = jaxtraj.PolicyPart(
        src,
        {"state": np.zeros((2, 11), np.float64)},
        PolicyOutput(actions=np.zeros((2, K, 3), np.float32)),
    )
    with pytest.raises(
        ValueError,
        match=r"observation 'state': env gives \(2, 11\) float32, "
        r"the collector's example has \(2, 11\) float64",
    ):
        EnvPoolEnv(pool, actions_per_chunk=K, policy_example=pol)
    EnvPoolEnv(pool, actions_per_chunk=K, obs_dtype=np.float64, policy_example=pol)


# ----------------------------------------------------------------------- clip_actions


def logged_pendulums(gym, log, batch):
    """InvertedPendulum-v5 single envs (action bounds [-3, 3], ctrllimited) that log
    each action they receive, per env, into ``log[i]``."""

    class ActionLog(gym.Wrapper):
        def __init__(self, env, i):
            super().__init__(env)
            self.i = i

        def step(self, action):
            log[self.i].append(np.array(action, copy=True))
            return self.env.step(action)

    return [lambda i=i: ActionLog(gym.make("InvertedPendulum-v5"), i) for i in range(batch)]


def assert_same_steps(a: EnvStep, b: EnvStep):
    for name in ("transition", "obs", "final_obs", "action_obs", "info"):
        jax.tree.map(np.testing.assert_array_equal, getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("chunk_end", ["continue", "cut"])
def test_gymnasium_clip_actions_sends_the_clipped_actions(gym, chunk_end):
    """InvertedPendulum-v5 fed actions in [-10, 10] with clip_actions=True: each
    sub-environment receives the actions clipped to [-3, 3] (float32, the space's dtype),
    and the EnvSteps are those of the adapter without clipping fed the clipped actions
    and, under "continue", of single environments fed them."""
    from gymnasium.vector import SyncVectorEnv

    Bn = 2
    rng = np.random.default_rng(3)
    actions = rng.uniform(-10, 10, (T, Bn, K, 1))
    clipped = np.clip(actions.astype(np.float32), -3, 3)
    assert (np.abs(actions) > 3).mean() > 0.5
    seeds = [SEED + i for i in range(Bn)]
    steps = {}
    for clip, given in ((True, actions), (False, clipped)):
        log = [[] for _ in range(Bn)]
        env = GymnasiumEnv(
            SyncVectorEnv(logged_pendulums(gym, log, Bn)),
            actions_per_chunk=K,
            seed=SEED,
            per_action_obs=True,
            chunk_end=chunk_end,
            clip_actions=clip,
        )
        assert env.clip_actions is clip
        _, steps[clip] = run_chunks(env, given)
        env.close()
        ran = np.stack(
            [np.ones((Bn, K), bool) if s.transition.valid_actions is None
             else s.transition.valid_actions for s in steps[clip]]
        )  # [T, B, K]
        for b in range(Bn):  # what the simulator received, in order
            got = np.stack(log[b])
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, clipped[:, b][ran[:, b]])
    done = np.stack([s.transition.terminations | s.transition.truncations for s in steps[True]])
    assert done.sum() >= 2, "the scenario needs episode ends"
    for a, b in zip(steps[True], steps[False]):
        assert_same_steps(a, b)
    if chunk_end == "continue":
        first, ref = reference([lambda: gym.make("InvertedPendulum-v5")] * Bn, seeds, clipped)
        for t, (step, want) in enumerate(zip(steps[True], ref)):
            try:
                assert_same(step, want)
            except AssertionError as e:
                raise AssertionError(f"chunk {t}: {e}") from e


def test_gymnasium_clip_actions_changes_a_control_cost(gym):
    """Why it matters for a dataset: MuJoCo clamps ctrl to ctrlrange in the dynamics,
    but Hopper-v5's control cost is computed on the action as given, so unclipped
    actions give other rewards than the clipped ones; clip_actions=True gives the
    clipped actions' rewards."""
    from gymnasium.vector import AutoresetMode

    actions = np.clip(hopper_actions() * 4, -4, 4)
    clipped = np.clip(actions, -1, 1)
    rewards = {}
    for name, clip, given in (("clip", True, actions), ("raw", False, actions),
                              ("ref", False, clipped)):
        env = GymnasiumEnv(hopper_vec(gym, AutoresetMode.NEXT_STEP), actions_per_chunk=K, seed=SEED,
                           chunk_end=MODE, clip_actions=clip)
        _, steps = run_chunks(env, given)
        env.close()
        rewards[name] = np.stack([s.transition.rewards for s in steps])
    np.testing.assert_array_equal(rewards["clip"], rewards["ref"])
    assert not np.allclose(rewards["raw"], rewards["ref"])


def test_envpool_clip_actions(envpool):
    """EnvPool Hopper-v4 (bounds [-1, 1]) with clip_actions=True fed actions in [-4, 4]
    steps as the pool fed the clipped actions (under both chunk ends)."""
    actions = hopper_actions() * 4
    clipped = np.clip(actions.astype(np.float64), -1, 1)
    for chunk_end in ("continue", "cut"):
        got = {}
        for clip, given in ((True, actions), (False, clipped)):
            pool = envpool.make("Hopper-v4", env_type="gymnasium", num_envs=B, seed=SEED)
            env = EnvPoolEnv(pool, actions_per_chunk=K, per_action_obs=True,
                             chunk_end=chunk_end, clip_actions=clip)
            _, got[clip] = run_chunks(env, given)
            env.close()
        for a, b in zip(got[True], got[False]):
            assert_same_steps(a, b)


def test_clip_actions_needs_a_box_action_space(gym):
    from gymnasium.vector import SyncVectorEnv

    vec = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    with pytest.raises(ValueError, match=r"GymnasiumEnv: clip_actions needs a Box action space"):
        GymnasiumEnv(vec, actions_per_chunk=K, clip_actions=True)
    GymnasiumEnv(vec, actions_per_chunk=K)  # without clipping a Discrete space is served
    vec.close()


# ----------------------------------------------------------------------- extras


def test_missing_extras_name_the_extra(tmp_path):
    """``import jaxtraj.envs`` needs neither gymnasium nor envpool; constructing an
    adapter without its library names the extra to install."""
    hide = tmp_path / "sitecustomize.py"
    hide.write_text(
        textwrap.dedent("""
        import sys
        class _Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("gymnasium", "envpool"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, _Hide())
    """)
    )
    code = textwrap.dedent("""
        import sys
        import jaxtraj
        import jaxtraj.envs
        from jaxtraj.envs import *  # noqa: F403
        assert "gymnasium" not in sys.modules and "envpool" not in sys.modules
        for cls, extra in ((jaxtraj.envs.GymnasiumEnv, "gymnasium"),
                           (jaxtraj.envs.EnvPoolEnv, "envpool")):
            try:
                cls(object(), actions_per_chunk=2)
            except ImportError as e:
                assert f"pip install 'jaxtraj[{extra}]'" in str(e), e
            else:
                raise AssertionError(f"{cls.__name__} built without {extra}")
        print("ok")
    """)
    paths = [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


# ----------------------------------------------------------------------- collection


def test_rollout_collection_end_to_end(gym):
    """A rollout-mode collector fed by a hand-written service loop over GymnasiumEnv
    (truncations every 3 steps and terminations, chunks of 4), terminal inference on
    ``final_obs``: the flushed Trajectory's obs, rewards (and the targets' chunk rewards,
    with gamma * V(final obs) at truncations), [T+1] flags and prev_values[T] match the
    reference loop."""
    from gymnasium.vector import AutoresetMode

    gamma, Bn = 0.9, 2
    w = np.linspace(-1, 1, 11).astype(np.float32)
    value_fn = lambda obs: obs @ w  # noqa: E731
    actions = hopper_actions(batch=Bn)
    actions[:, 1] = 0.1  # env 1 stands and is truncated; env 0 falls (terminations)
    makers = [lambda: gym.make("Hopper-v5", max_episode_steps=6)] * Bn
    first, ref = reference(makers, [SEED, SEED + 1], actions)
    trunc = np.stack([c["truncations"] for c in ref])
    assert trunc.any() and np.stack([c["terminations"] for c in ref]).any()

    env = GymnasiumEnv(
        hopper_vec(gym, AutoresetMode.NEXT_STEP, batch=Bn, max_steps=6),
        actions_per_chunk=K,
        seed=SEED,
        chunk_end=MODE,
    )
    plan = TrajectoryPlan(num_chunks=T, batch_size=Bn, gamma=gamma)
    out_example = PolicyOutput(
        actions=np.zeros((Bn, K, 3), np.float32), prev_values=np.zeros((Bn,), np.float32)
    )
    collector = jaxtraj.TrajectoryCollector(plan, *example_parts(env, plan, out_example))
    env.check_against(collector)
    obs, prev, items = env.reset(), None, []
    for t in range(T):
        key = TrajectoryKey(0, 0, 0, 0, t)
        src = jaxtraj.TrajectorySource(key, Bn, 0)
        out = PolicyOutput(actions=actions[t], prev_values=value_fn(obs["state"]))
        items += collector.add(jaxtraj.PolicyPart(src, obs, out))
        step = env.step(key, actions[t])
        part = env_part(plan, key, step, prev)
        final_values = np.zeros((Bn,), np.float32)
        if t == T - 1 or step.transition.truncations.any():
            final_values = np.asarray(value_fn(step.final_obs["state"]), np.float32)
        items += collector.add(part.replace(final_values=final_values))
        obs, prev = step.obs, step.transition
    env.close()
    assert len(items) == 1
    traj = items[0][1]

    obs_ref = np.stack([first] + [c["obs"] for c in ref[:-1]])  # [T, B, 11]
    np.testing.assert_array_equal(np.asarray(traj.obs["state"])[0], obs_ref)
    rewards = np.stack([c["rewards"] for c in ref])  # [T, B, K]
    v_final = np.stack([value_fn(c["final_obs"]) for c in ref])  # [T, B]
    terms = np.stack([c["terminations"] for c in ref])
    # The env's rewards as given; the targets' chunk rewards add gamma * V(final obs) at
    # a chunk's first end where that is a truncation.
    np.testing.assert_array_equal(np.asarray(traj.rewards)[0], rewards)
    targets = jaxtraj.trajectory_targets(plan, traj)
    want = chunk_rewards(rewards, terms, trunc, v_final, gamma)
    np.testing.assert_allclose(np.asarray(targets.rewards)[0], want, rtol=1e-5, atol=1e-5)
    zeros = np.zeros((1, Bn, K), bool)
    np.testing.assert_array_equal(np.asarray(traj.truncations)[0], np.concatenate([zeros, trunc]))
    np.testing.assert_array_equal(np.asarray(traj.terminations)[0], np.concatenate([zeros, terms]))
    np.testing.assert_array_equal(np.asarray(traj.dones)[0], np.concatenate([zeros, terms | trunc]))
    values = np.asarray(traj.prev_values)[0]  # [T+1, B]
    np.testing.assert_allclose(values[:T], np.stack([value_fn(o) for o in obs_ref]), rtol=1e-6)
    np.testing.assert_allclose(values[T], value_fn(ref[-1]["final_obs"]), rtol=1e-6)


@pytest.mark.parametrize(
    "runner_name, source",
    [
        ("AsyncRunner", "NEXT_STEP"),
        ("AsyncRunner", "SAME_STEP"),
        ("AsyncRunner", "envpool"),
        ("DecoupledRunner", "NEXT_STEP"),
    ],
)
def test_runner_over_an_adapter_with_terminal_inference_equals_the_reference(
    gym, runner_name, source
):
    """The user's path: an adapter (GymnasiumEnv in either autoreset mode, EnvPoolEnv;
    episodes ending mid-chunk by termination and by truncation) in a host runner whose
    value_fn runs terminal inference on the policy side; called once per training step (two steps, the env
    carried across them). The Trajectories equal the reference loop over single envs
    field by field: observations, rewards (the chunk rewards of the targets with gamma *
    V(final obs) at truncations), the [T+1] flags and prev_values[T] = V(s_T). (DecoupledRunner's policy halves carry
    the observation its pipelined inference saw, one chunk stale by design: its
    observations and pre-action values are not the reference's.)"""
    from gymnasium.vector import AutoresetMode

    from jaxtraj.runners import threads

    gamma, Bn, steps = 0.9, 2, 2
    w = np.linspace(-1, 1, 11).astype(np.float32)
    value = lambda obs: (obs @ w).astype(np.float32)  # noqa: E731
    actions = hopper_actions(t_chunks=steps * T, batch=Bn)
    actions[:, 1] = 0.1  # env 1 stands and is truncated; env 0 falls (terminations)
    if source == "envpool":  # EnvPool's Hopper-v4, host API, through EnvPoolEnv
        envpool = pytest.importorskip("envpool")
        first, ref = envpool_reference(envpool, [SEED, SEED + 1], actions, max_steps=6)
        pool = envpool.make(
            "Hopper-v4", env_type="gymnasium", num_envs=Bn, seed=SEED, max_episode_steps=6
        )
        env = EnvPoolEnv(pool, actions_per_chunk=K, chunk_end=MODE)
    else:  # gymnasium's Hopper-v5 in either autoreset mode, through GymnasiumEnv
        makers = [lambda: gym.make("Hopper-v5", max_episode_steps=6)] * Bn
        first, ref = reference(makers, [SEED, SEED + 1], actions)
        mode = getattr(AutoresetMode, source)
        vec = hopper_vec(gym, mode, batch=Bn, max_steps=6)
        env = GymnasiumEnv(vec, actions_per_chunk=K, seed=SEED, chunk_end=MODE)
    calls = iter(range(steps * T))

    def policy_fn(params, obs, rng):  # replays the reference's actions, in chunk order
        t = next(calls)
        return PolicyOutput(actions=actions[t], prev_values=value(obs["state"]))

    plan = TrajectoryPlan(num_chunks=T, batch_size=Bn, gamma=gamma)
    out_example = PolicyOutput(
        actions=np.zeros((Bn, K, 3), np.float32), prev_values=np.zeros((Bn,), np.float32)
    )
    collector = jaxtraj.TrajectoryCollector(plan, *example_parts(env, plan, out_example))
    kw = {"max_batch": 1} if runner_name == "DecoupledRunner" else {}
    runner = getattr(threads, runner_name)(
        collector, [env], policy_fn, None, value_fn=lambda p, o: value(o["state"]), **kw
    )
    trajs = [tr for _ in range(steps) for _, tr in runner.run(num_steps=1)]
    env.close()
    assert [int(tr.step_id) for tr in trajs] == list(range(steps))
    trunc = np.stack([c["truncations"] for c in ref])
    terms = np.stack([c["terminations"] for c in ref])
    # Truncations mid-epoch (bootstrapped); gymnasium's Hopper-v5 also falls (terminations)
    # within the 6-step limit, EnvPool's Hopper-v4 not (its terminations: the EnvStep tests).
    assert trunc[:-1].any() and (terms.any() or source == "envpool")
    obs_ref = np.stack([first] + [c["obs"] for c in ref[:-1]])  # [steps*T, B, 11]
    rewards = np.stack([c["rewards"] for c in ref])
    v_final = np.stack([value(c["final_obs"]) for c in ref])
    for s, traj in enumerate(trajs):
        at = slice(s * T, (s + 1) * T)
        if runner_name == "AsyncRunner":
            np.testing.assert_array_equal(np.asarray(traj.obs["state"])[0], obs_ref[at])
        np.testing.assert_array_equal(np.asarray(traj.rewards)[0], rewards[at])
        want = chunk_rewards(rewards[at], terms[at], trunc[at], v_final[at], gamma)
        targets = jaxtraj.trajectory_targets(plan, traj)
        np.testing.assert_allclose(np.asarray(targets.rewards)[0], want, rtol=1e-5, atol=1e-5)
        before = np.zeros((1, Bn, K), bool) if s == 0 else None
        for name, flags in (("truncations", trunc), ("terminations", terms)):
            prev = before if s == 0 else flags[s * T - 1][None]
            np.testing.assert_array_equal(
                np.asarray(getattr(traj, name))[0], np.concatenate([prev, flags[at]]), name
            )
        values = np.asarray(traj.prev_values)[0]
        if runner_name == "AsyncRunner":
            np.testing.assert_allclose(values[:T], value(obs_ref[at]), rtol=1e-6)
        np.testing.assert_allclose(values[T], v_final[(s + 1) * T - 1], rtol=1e-6)


def test_envpool_make_is_a_factory_runners_can_pickle(envpool):
    """EnvPoolEnv.make builds the pool where it is called: the chunks equal a pool built
    by hand with the same seed, and a partial of it pickles, as an env process needs (a
    pool itself does not)."""
    import functools
    import pickle

    actions = hopper_actions(batch=2)
    made = EnvPoolEnv.make("Hopper-v4", 2, actions_per_chunk=K, seed=SEED, chunk_end=MODE)
    pool = envpool.make("Hopper-v4", env_type="gymnasium", num_envs=2, seed=SEED)
    by_hand = EnvPoolEnv(pool, actions_per_chunk=K, chunk_end=MODE)
    for a, b in zip(run_chunks(made, actions)[1], run_chunks(by_hand, actions)[1]):
        assert_same_steps(a, b)
    factory = functools.partial(EnvPoolEnv.make, "Hopper-v4", 2, actions_per_chunk=K, seed=SEED,
                                chunk_end=MODE)
    assert pickle.loads(pickle.dumps(factory))().spec() == made.spec()
