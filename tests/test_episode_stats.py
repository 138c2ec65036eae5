"""Episode statistics of every flush against gymnasium's own ``RecordEpisodeStatistics`` on the
same run: a MuJoCo env (InvertedPendulum-v5, short time limit: terminations and
truncations), each sub-environment wrapped, stepped through ``GymnasiumEnv`` in both
chunk-end modes, over several training steps (episodes that span steps); and the bad
``valid_actions`` rows refused naming the field, the key and the row."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtraj
from jaxtraj import CollectorError, ErrorCode, PolicyOutput, TrajectoryKey, TrajectoryPlan
from jaxtraj.checks import invalid_action_rows
from jaxtraj.envs import GymnasiumEnv, example_parts
from jaxtraj.runners.service import env_part

B, T, K, STEPS, LIMIT = 3, 4, 3, 4, 7


def _pendulum_vec(gym):
    from gymnasium.vector import SyncVectorEnv
    from gymnasium.wrappers import RecordEpisodeStatistics

    make = lambda: RecordEpisodeStatistics(  # noqa: E731
        gym.make("InvertedPendulum-v5", max_episode_steps=LIMIT)
    )
    return SyncVectorEnv([make for _ in range(B)])


@pytest.mark.parametrize("chunk_end", ["cut", "continue"])
@pytest.mark.parametrize("mode", ["rollout", "pipeline"])
def test_episode_statistics_equal_record_episode_statistics(chunk_end, mode):
    gym = pytest.importorskip("gymnasium")
    vec = _pendulum_vec(gym)
    env = GymnasiumEnv(vec, actions_per_chunk=K, seed=3, chunk_end=chunk_end)
    plan = TrajectoryPlan(num_chunks=T, batch_size=B, gamma=0.9, mode=mode)
    w = np.linspace(-1, 1, 4).astype(np.float32)
    example = PolicyOutput(actions=np.zeros((B, K, 1), np.float32),
                           prev_values=np.zeros((B,), np.float32))
    collector = jaxtraj.TrajectoryCollector(plan, *example_parts(env, plan, example))
    rng = np.random.default_rng(0)
    obs, prev, got = env.reset(), None, []
    for step in range(STEPS):
        for t in range(T):
            key = TrajectoryKey(step, 0, 0, 0, t)
            src = jaxtraj.TrajectorySource(key, B, 0)
            actions = rng.uniform(-3, 3, (B, K, 1)).astype(np.float32)
            collector.add(jaxtraj.PolicyPart(src, obs, PolicyOutput(actions, prev_values=obs["state"] @ w)))
            out = env.step(key, actions)
            part = env_part(plan, key, out, prev).replace(final_values=out.final_obs["state"] @ w)
            for _, item in collector.add(part):
                got += item.episodes.to_list()
            obs, prev = out.obs, out.transition
    env.close()
    assert got, "no episode ended"
    for b, sub in enumerate(vec.envs):  # the wrapper's own record, episode by episode
        mine = [e for e in got if e["row"] == b]
        assert [e["length"] for e in mine] == list(sub.length_queue)
        np.testing.assert_allclose([e["return"] for e in mine], list(sub.return_queue),
                                   rtol=1e-5)
    # Several steps: some episodes began in an earlier training step than they ended in.
    assert any(e["length"] > T * K for e in got) or len({e["step_id"] for e in got}) > 1
    assert any(e["truncated"] for e in got) and any(e["terminated"] for e in got)


# -- bad valid_actions ------------------------------------------------------------------------

BAD_MASKS = [
    ("a run that stops without a done", [1, 1, 0], [0, 0, 0]),
    ("an action valid right after a done", [1, 1, 1], [0, 1, 0]),
    ("a gap that is not a reset step", [1, 0, 1], [0, 0, 0]),
    ("a done on an action that did not run", [1, 0, 0], [0, 0, 1]),
]


def _parts(valid, dones, rewards=None):
    plan = TrajectoryPlan(num_chunks=2, batch_size=B, gamma=0.9)
    no = np.zeros((B, K), bool)
    ok = np.ones((B, K), bool)
    p = [jaxtraj.PolicyPart.at(chunk_id=t, obs=np.zeros((B, 2), np.float32),
                               actions=np.zeros((B, K, 1), np.float32),
                               prev_values=np.zeros((B,), np.float32)) for t in range(2)]
    env = lambda t, v, d, r: jaxtraj.EnvPart.at(  # noqa: E731
        chunk_id=t, rewards=r, terminations=d, truncations=no, valid_actions=v,
        initial_transition=jaxtraj.EnvTransition(terminations=no, truncations=no, valid_actions=ok)
        if t == 0 else None, final_values=np.zeros((B,), np.float32))
    v_bad, d_bad = ok.copy(), no.copy()
    v_bad[2], d_bad[2] = np.asarray(valid, bool), np.asarray(dones, bool)
    r_bad = np.zeros((B, K), np.float32) if rewards is None else rewards
    good = env(0, ok, no, np.ones((B, K), np.float32))
    return plan, p, good, env(1, v_bad, d_bad, r_bad)


@pytest.mark.parametrize("name,valid,dones", BAD_MASKS, ids=[m[0] for m in BAD_MASKS])
def test_a_bad_valid_actions_row_is_refused_naming_field_key_and_row(name, valid, dones):
    plan, p, good, bad = _parts(valid, dones)
    c = jaxtraj.TrajectoryCollector(plan, p[0], good)
    for part in (p[0], good, p[1]):
        c.add(part)
    with pytest.raises(CollectorError) as info:
        c.add(bad)
    err = info.value
    assert err.code == ErrorCode.INVALID_ACTION_MASK
    assert err.key == (0, 0, 0, 0, 1)
    assert "EnvTransition.valid_actions row 2" in str(err)
    # Nothing collected is lost: the right half still completes the step.
    fixed = bad.replace(transition=bad.transition.replace(
        valid_actions=np.ones((B, K), bool), terminations=np.zeros((B, K), bool)))
    (_, traj), = c.add(fixed)
    np.testing.assert_array_equal(np.asarray(traj.rewards)[0, 0], np.ones((B, K)))
    # A stack through add_many names it too, and under jit the pure functions record it.
    c2 = jaxtraj.TrajectoryCollector(plan, p[0], good)
    with pytest.raises(CollectorError, match="valid_actions row 2") as info:
        c2.add_many([p[0], good, p[1], bad])
    state = jaxtraj.init(plan, p[0], good)
    add_env = jax.jit(jaxtraj.add_env, static_argnums=0)
    state = add_env(plan, state, bad)
    with pytest.raises(CollectorError) as info:
        jaxtraj.raise_if_error(state)
    assert info.value.code == ErrorCode.INVALID_ACTION_MASK and info.value.key == (0, 0, 0, 0, 1)


def test_a_reward_on_an_action_that_did_not_run_is_refused_and_reset_steps_are_accepted():
    r = np.zeros((B, K), np.float32)
    r[2, 2] = 1.0
    plan, p, good, bad = _parts([1, 1, 0], [0, 1, 0], rewards=r)
    c = jaxtraj.TrajectoryCollector(plan, p[0], good)
    with pytest.raises(CollectorError, match="valid_actions row 2"):
        c.add(bad)
    # EnvPool's reset step, at the chunk's start or right after a done, and a full run.
    for valid, dones in (([0, 1, 1], [0, 0, 0]), ([1, 0, 1], [1, 0, 0]), ([1, 1, 1], [0, 0, 0])):
        plan, p, good, fine = _parts(valid, dones)
        c = jaxtraj.TrajectoryCollector(plan, p[0], good)
        for part in (p[0], good, p[1]):
            c.add(part)
        (_, traj), = c.add(fine)
        np.testing.assert_array_equal(np.asarray(traj.valid_actions)[0, 1, 2], valid)


def _loop_invalid(valid, dones, rewards):
    """The chunk-end rule for one row, written as a plain loop (independent of the kernel)."""
    K = len(valid)
    for j in range(K):
        if not valid[j] and (dones[j] or rewards[j] != 0):
            return True
        if j + 1 < K:
            if valid[j] and not valid[j + 1] and not dones[j]:
                return True
            if dones[j] and valid[j + 1]:
                return True
            if not valid[j] and valid[j + 1] and j > 0 and not dones[j - 1]:
                return True
    return False


def test_the_host_mask_rule_equals_a_plain_loop_on_every_row_of_three_actions():
    rows = [(v, d, r) for v in itertools.product([0, 1], repeat=3)
            for d in itertools.product([0, 1], repeat=3) for r in ([0, 0, 0], [0, 0, 1.5])]
    valid = np.asarray([v for v, _, _ in rows], bool)
    dones = np.asarray([d for _, d, _ in rows], bool)
    rewards = np.asarray([r for _, _, r in rows], np.float32)
    want = [_loop_invalid(*row) for row in rows]
    no = np.zeros_like(dones)
    tr = jaxtraj.EnvTransition(rewards=rewards, terminations=dones, truncations=no,
                               valid_actions=valid)
    np.testing.assert_array_equal(invalid_action_rows(np, tr), want)
    np.testing.assert_array_equal(np.asarray(invalid_action_rows(jnp, tr)), want)
    # A batch whose rows all ran (the host's fast path), dones anywhere; chunk-level dones.
    ran = valid.all(axis=1)
    full = tr.replace(valid_actions=np.ones_like(valid))
    np.testing.assert_array_equal(
        invalid_action_rows(np, full), [_loop_invalid([1, 1, 1], d, r) for _, d, r in rows])
    chunk = jaxtraj.EnvTransition(rewards=rewards[ran], dones=dones[ran, -1],
                                  valid_actions=valid[ran])  # a done on the last action
    assert ran.sum() == 16 and not np.any(invalid_action_rows(np, chunk))
