"""The original collector's reward and intervention semantics (issue 27): the reward-weight
rule, and model-side intervention flags, against hand-computed values."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import jaxtraj
from jaxtraj import EnvPart, EnvTransition, PolicyPart

# Small shapes: 2 chunks, 1 epoch, 2 envs, K = 2 actions of 1 dimension.
T, B, K = 2, 2, 2
PLAN = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B, truncation_bootstrap="none")
NO = np.zeros((B,), bool)
ENV_R = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)  # [T, B] chunk-level env rewards
RM = np.array([[10.0, -10.0], [0.5, 0.0]], np.float32)  # [T, B] reward-model scores


def rparts(rm=None):
    """Both halves of every chunk, chunk-level rewards, optionally a reward model."""
    out = []
    for t in range(T):
        out.append(
            PolicyPart.at(
                chunk_id=t,
                obs=np.zeros((B, 1), np.float32),
                actions=np.zeros((B, K, 1), np.float32),
                prev_values=np.zeros((B,), np.float32),
            )
        )
        out.append(
            EnvPart.at(
                chunk_id=t,
                rewards=ENV_R[t],
                terminations=NO,
                truncations=NO,
                reward_model_output=None if rm is None else rm[t],
                initial_transition=EnvTransition(terminations=NO, truncations=NO) if t == 0 else None,
                final_values=np.zeros((B,), np.float32) if t == T - 1 else None,
            )
        )
    return out


def facade(plan, ps):
    c = jaxtraj.TrajectoryCollector(plan, ps[0], ps[1])
    out = []
    for p in ps:
        out += c.add(p)
    assert len(out) == 1
    return out[0][1]


def pure(plan, ps):
    add_p = jax.jit(jaxtraj.add_policy, static_argnums=0)
    add_e = jax.jit(jaxtraj.add_env, static_argnums=0)
    state = jaxtraj.init(plan, ps[0], ps[1])
    for p in ps:
        state = (add_p if isinstance(p, PolicyPart) else add_e)(plan, state, p)
    jaxtraj.raise_if_error(state)
    traj, state = jax.jit(jaxtraj.rollout.flush, static_argnums=0)(plan, state, 0)
    return traj


# -- the reward-weight rule ------------------------------------------------------------------


def test_compute_rewards_by_hand():
    r = np.array([1.0, -2.0], np.float32)
    rm = np.array([4.0, 8.0], np.float32)
    alone = EnvTransition(rewards=r)
    scored = EnvTransition(rewards=r, reward_model_output=rm)
    for w in (0.0, 0.5, 1.0, 3.0):  # no reward model: the env's reward, whatever the weights
        np.testing.assert_array_equal(
            alone.compute_rewards(env_reward_weight=w, reward_model_weight=2.0), r
        )
    np.testing.assert_allclose(scored.compute_rewards(), [5.0, 6.0])  # jaxtraj's defaults
    np.testing.assert_allclose(  # the original's default env_reward_weight = 0.0
        scored.compute_rewards(env_reward_weight=0.0, reward_model_weight=0.5), [2.0, 4.0]
    )
    np.testing.assert_allclose(
        scored.compute_rewards(env_reward_weight=0.5, reward_model_weight=2.0), [8.5, 15.0]
    )
    # Action-level rewards [B, K], the model's score alike.
    per_action = EnvTransition(rewards=np.ones((2, 2), np.float32),
                               reward_model_output=np.array([[0, 1], [2, 3]], np.float32))
    np.testing.assert_allclose(
        per_action.compute_rewards(env_reward_weight=2.0, reward_model_weight=-1.0),
        [[2.0, 1.0], [0.0, -1.0]],
    )
    assert EnvTransition(reward_model_output=rm).compute_rewards() is None  # no env rewards


@pytest.mark.parametrize("run", [facade, pure], ids=["facade", "jit"])
@pytest.mark.parametrize(
    "w_env,w_rm,rm,want",
    [
        (0.5, 2.0, None, ENV_R),  # no reward model: unchanged
        (0.0, 2.0, None, ENV_R),
        (1.0, 1.0, RM, ENV_R + RM),  # the defaults: [[11, -8], [3.5, 4]]
        (0.0, 1.0, RM, RM),  # the original's default: the model's score only
        (0.5, 2.0, RM, [[20.5, -19.0], [2.5, 2.0]]),
    ],
)
def test_the_rule_through_the_collector(run, w_env, w_rm, rm, want):
    plan = dataclasses.replace(PLAN, env_reward_weight=w_env, reward_model_weight=w_rm)
    traj = run(plan, rparts(rm))
    np.testing.assert_allclose(np.asarray(traj.rewards)[0], want, rtol=1e-6)


def test_the_rule_in_pipeline_mode():
    plan = dataclasses.replace(
        PLAN, mode="pipeline", env_reward_weight=0.5, reward_model_weight=2.0,
        normalize_advantages=False, advantage="returns",
    )
    for rm, want in ((None, ENV_R), (RM, 0.5 * ENV_R + 2.0 * RM)):
        c = jaxtraj.TrajectoryCollector(plan, *rparts(rm)[:2], rng=jax.random.PRNGKey(0))
        out = []
        for p in rparts(rm)[::-1]:  # any order
            out += c.add(p)
        ((_, mb),) = out  # one epoch, one rank: every sample, shuffled
        rewards = np.asarray(mb.rewards).reshape(-1)[np.asarray(mb.loss_mask).reshape(-1)]
        np.testing.assert_allclose(np.sort(rewards), np.sort(np.asarray(want).reshape(-1)))
