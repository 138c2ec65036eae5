"""Training targets through the collector: truncation bootstrap by reward composition,
reward-model weights, the critic-free form."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxtraj
from jaxtraj import (
    EnvPart,
    EnvTransition,
    PolicyOutput,
    PolicyPart,
    TrajectoryKey,
    TrajectorySource,
)


def parts(*, values=(0.5, 1.0, 1.5), rewards=(1.0, 2.0, 3.0), truncated_at=1, final=None, rm=None):
    """One env, three chunks: chunk-level rewards, a truncation at ``truncated_at``."""
    final = final or {1: 4.0, 2: 2.0}
    out = []
    for t in range(3):
        src = TrajectorySource(TrajectoryKey(0, 0, 0, 0, t), 1, 0)
        out.append(
            PolicyPart(
                source=src,
                obs={"state": np.zeros((1, 2), np.float32)},
                output=PolicyOutput(
                    actions=np.zeros((1, 2), np.float32),
                    prev_values=np.array([values[t]], np.float32),
                ),
            )
        )
        no = np.zeros((1,), bool)
        out.append(
            EnvPart(
                source=src,
                transition=EnvTransition(
                    rewards=np.array([rewards[t]], np.float32),
                    terminations=no,
                    truncations=np.array([t == truncated_at]),
                    reward_model_output=None if rm is None else np.array([rm[t]], np.float32),
                ),
                initial_transition=EnvTransition(terminations=no, truncations=no)
                if t == 0
                else None,
                final_values=np.array([final[t]], np.float32) if t in final else None,
            )
        )
    return out


def collect(plan, ps):
    c = jaxtraj.TrajectoryCollector(plan, ps[0], ps[1])
    out = []
    for p in ps:
        out += c.add(p)
    return out[0][1]


def test_truncation_bootstraps_through_the_chunk_reward():
    plan = jaxtraj.TrajectoryPlan(num_chunks=3, batch_size=1, gamma=0.9, gae_lambda=0.5)
    traj = collect(plan, parts())
    np.testing.assert_allclose(traj.rewards[0, :, 0], [1.0, 2.0, 3.0])  # as the env gave them
    # r_1 = 2 + gamma * V(final obs) = 2 + 0.9 * 4 = 5.6; the truncation cuts the trace.
    tg = jaxtraj.trajectory_targets(plan, traj)
    np.testing.assert_allclose(tg.rewards[0, :, 0], [1.0, 5.6, 3.0], rtol=1e-6)
    np.testing.assert_array_equal(traj.dones[0, :, 0], [False, False, True, False])
    np.testing.assert_allclose(traj.prev_values[0, :, 0], [0.5, 1.0, 1.5, 2.0])
    tg = jaxtraj.trajectory_targets(plan, traj)
    # Worked by hand:
    # delta_2 = 3 + 0.9*2.0 - 1.5 = 3.3                         A_2 = 3.3
    # delta_1 = 5.6 + 0.9*1.5*(1-1) - 1.0 = 4.6                 A_1 = 4.6 (cut)
    # delta_0 = 1 + 0.9*1.0 - 0.5 = 1.4                         A_0 = 1.4 + 0.45*4.6 = 3.47
    np.testing.assert_allclose(tg.advantages[0, :, 0], [3.47, 4.6, 3.3], rtol=1e-5)
    np.testing.assert_allclose(tg.returns[0, :, 0], [3.97, 5.6, 4.8], rtol=1e-5)


def test_termination_never_bootstraps_and_bootstrap_can_be_off():
    plan = jaxtraj.TrajectoryPlan(
        num_chunks=3, batch_size=1, gamma=0.9, truncation_bootstrap="none"
    )
    traj = collect(plan, parts())
    np.testing.assert_allclose(traj.rewards[0, :, 0], [1.0, 2.0, 3.0])
    term = parts(truncated_at=-1)
    term[3] = term[3].replace(transition=term[3].transition.replace(terminations=np.array([True])))
    traj = collect(jaxtraj.TrajectoryPlan(num_chunks=3, batch_size=1, gamma=0.9), term)
    np.testing.assert_allclose(traj.rewards[0, :, 0], [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(traj.dones[0, :, 0], [False, False, True, False])


def test_reward_model_weights():
    plan = jaxtraj.TrajectoryPlan(
        num_chunks=3,
        batch_size=1,
        env_reward_weight=0.5,
        reward_model_weight=2.0,
        truncation_bootstrap="none",
    )
    traj = collect(plan, parts(rm=(1.0, 0.0, -1.0)))
    np.testing.assert_allclose(traj.rewards[0, :, 0], [0.5 + 2.0, 1.0, 1.5 - 2.0])


@pytest.mark.parametrize("advantage", ["returns"])
def test_critic_free_returns(advantage):
    plan = jaxtraj.TrajectoryPlan(
        num_chunks=3, batch_size=1, gamma=0.5, advantage=advantage, truncation_bootstrap="none"
    )
    tg = jaxtraj.trajectory_targets(plan, collect(plan, parts()))
    # discounted sums cut at the done after chunk 1: G_2 = 3, G_1 = 2, G_0 = 1 + 0.5*2
    np.testing.assert_allclose(tg.returns[0, :, 0], [2.0, 2.0, 3.0])
    np.testing.assert_allclose(tg.advantages, tg.returns)


def test_a_done_in_the_middle_of_a_chunk():
    """Auto-reset inside a chunk: action 0 of chunk 1 ends the episode (K = 2 actions)."""
    plan = jaxtraj.TrajectoryPlan(num_chunks=3, batch_size=1, gamma=0.9, gae_lambda=0.5)
    ps = parts(truncated_at=-1)
    for i, p in enumerate(ps):
        if isinstance(p, EnvPart):  # action-level flags and rewards [B, K]
            t = i // 2
            term = np.array([[t == 1, False]])
            no = np.zeros((1, 2), bool)
            tr = p.transition.replace(
                rewards=np.array([[p.transition.rewards[0], 0.0]], np.float32),
                terminations=term,
                truncations=no,
            )
            initial = EnvTransition(terminations=no, truncations=no) if t == 0 else None
            ps[i] = p.replace(transition=tr, initial_transition=initial)
    traj = collect(plan, ps)
    assert traj.dones.shape == (1, 4, 1, 2)
    np.testing.assert_array_equal(traj.dones[0, 2, 0], [True, False])  # after chunk 1, action 0
    tg = jaxtraj.trajectory_targets(plan, traj)
    np.testing.assert_array_equal(tg.dones[0, :, 0], [False, False, True, False])  # chunk level
    # By hand, rewards summed per chunk [1, 2, 3], values [0.5, 1, 1.5, 2], cut after chunk 1:
    # A_2 = 3 + 0.9*2 - 1.5 = 3.3; A_1 = 2 - 1 = 1.0; A_0 = 1 + 0.9*1 - 0.5 + 0.45*1.0 = 1.85
    np.testing.assert_allclose(tg.advantages[0, :, 0], [1.85, 1.0, 3.3], rtol=1e-5)
    # As dataset frames (one per action) the episode ends exactly there.
    frames, done, _ = jaxtraj.types.trajectory_frames(traj, per_action=True, actions_per_chunk=2)
    np.testing.assert_array_equal(done[:, 0], [False, False, True, False, False, False])


def test_reward_model_signal_of_another_batch_is_rejected():
    plan = jaxtraj.TrajectoryPlan(num_chunks=3, batch_size=1)
    ps = parts(rm=(1.0, 0.0, -1.0))
    c = jaxtraj.TrajectoryCollector(plan, ps[0], ps[1])
    bad = ps[3].replace(
        transition=ps[3].transition.replace(reward_model_output=np.zeros((2,), np.float32))
    )
    with pytest.raises(jaxtraj.CollectorError, match="reward_model_output") as info:
        c.add(bad)
    assert info.value.code == jaxtraj.ErrorCode.STRUCTURE_MISMATCH
    for p in ps:  # nothing was lost: the step completes as before
        out = c.add(p)
    assert len(out) == 1


def test_env_reward_weight_applies_only_with_a_reward_model():
    """The original system's rule: without a reward-model output the environment's reward
    passes unchanged, whatever ``env_reward_weight`` says."""
    plan = jaxtraj.TrajectoryPlan(
        num_chunks=3, batch_size=1, env_reward_weight=0.5, truncation_bootstrap="none"
    )
    traj = collect(plan, parts())
    np.testing.assert_allclose(traj.rewards[0, :, 0], [1.0, 2.0, 3.0])


def test_reward_model_weights_defaults_and_the_originals():
    """jaxtraj's default env_reward_weight=1.0 adds the model's score to the env's reward;
    the original system's default 0.0 keeps only the model's score."""
    rm = (1.0, 0.0, -1.0)
    plan = jaxtraj.TrajectoryPlan(num_chunks=3, batch_size=1, truncation_bootstrap="none")
    traj = collect(plan, parts(rm=rm))
    np.testing.assert_allclose(traj.rewards[0, :, 0], [1.0 + 1.0, 2.0 + 0.0, 3.0 - 1.0])
    original = dataclasses.replace(plan, env_reward_weight=0.0, reward_model_weight=3.0)
    traj = collect(original, parts(rm=rm))
    np.testing.assert_allclose(traj.rewards[0, :, 0], [3.0, 0.0, -3.0])


def test_action_gamma_discounts_inside_the_chunk_and_gamma_per_chunk():
    """Per-action discount g: gamma = g**K between chunks, action_gamma = g inside one; the
    chunk-level returns then equal the per-action discounted returns at chunk starts."""
    g, K = 0.9, 2
    rewards = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)  # [T, K]
    ps = parts(truncated_at=-1)
    for i, p in enumerate(ps):
        if isinstance(p, EnvPart):
            no = np.zeros((1, K), bool)
            tr = p.transition.replace(
                rewards=rewards[i // 2][None], terminations=no, truncations=no
            )
            ps[i] = p.replace(transition=tr, initial_transition=tr.boundary() if i == 1 else None)
    plan = jaxtraj.TrajectoryPlan(
        num_chunks=3, batch_size=1, gamma=g**K, action_gamma=g, advantage="returns"
    )
    tg = jaxtraj.trajectory_targets(plan, collect(plan, ps))
    flat = rewards.reshape(-1)
    per_action = [sum(g**j * r for j, r in enumerate(flat[k:])) for k in range(0, 6, K)]
    np.testing.assert_allclose(tg.returns[0, :, 0], per_action, rtol=1e-5)
    summed = jaxtraj.TrajectoryPlan(num_chunks=3, batch_size=1, gamma=g**K, advantage="returns")
    tg = jaxtraj.trajectory_targets(summed, collect(summed, ps))
    np.testing.assert_allclose(tg.rewards[0, :, 0], rewards.sum(1))  # the default: summed
    with pytest.raises(ValueError, match="action_gamma"):
        jaxtraj.TrajectoryPlan(num_chunks=3, action_gamma=0.0)
