"""jaxtraj.types: the data contract. Split and merge of fragments, the temporal layout of
``Trajectory``, ``TrajectoryStep.from_parts`` and its interventions, ``chunk_size`` (``K``
from the action chunk) and ``EnvTransition.cut_flags`` (which flags cut an episode)."""

from __future__ import annotations

import functools

import chex
import numpy as np
import pytest
from helpers import PLAN, A, B, E, K, T, all_parts, assert_same, env_part, policy_part, reference

import jaxtraj
from jaxtraj import CollectorError, EnvTransition, ErrorCode, TrajectoryPlan, TrajectoryStep
from jaxtraj.types import chunk_size


def test_split_merge_round_trip():
    p = policy_part(1)
    frags = p.split([1, 2, 1])
    assert [int(f.source.offset) for f in frags] == [0, 1, 3]
    chex.assert_shape(frags[1].obs["state"], (2, 5))
    assert_same(jaxtraj.PolicyPart.merge(frags[::-1]), p)
    v = env_part(0)
    assert_same(jaxtraj.EnvPart.merge(v.split([3, 1])), v)
    with pytest.raises(ValueError, match="contiguous"):
        jaxtraj.PolicyPart.merge([frags[0], frags[2]])
    with pytest.raises(ValueError, match="sum to"):
        p.split([1, 1])


def test_layout_matches_hand_built_example():
    tr = reference()
    # Hand-built expectations from the helpers' tagging scheme.
    for e in range(E):
        for t in range(T):
            p, v = policy_part(t, e), env_part(t, e)
            np.testing.assert_array_equal(tr.obs["image"][e, t], p.obs["image"])
            np.testing.assert_array_equal(tr.obs["state"][e, t], p.obs["state"])
            np.testing.assert_array_equal(tr.actions[e, t], p.output.actions)
            np.testing.assert_array_equal(tr.prev_logprobs[e, t], p.output.prev_logprobs)
            np.testing.assert_array_equal(
                tr.forward_inputs["tokens"][e, t], p.output.forward_inputs["tokens"]
            )
            np.testing.assert_array_equal(tr.rewards[e, t], v.transition.rewards)
            np.testing.assert_array_equal(tr.prev_values[e, t], p.output.prev_values)
            # dones index t+1 is the done after action t
            np.testing.assert_array_equal(tr.dones[e, t + 1], v.transition.terminations)
        # index 0: d_before from chunk zero's initial_transition
        init = env_part(0, e).initial_transition
        np.testing.assert_array_equal(tr.dones[e, 0], init.terminations | init.truncations)
        np.testing.assert_array_equal(tr.terminations[e, 0], init.terminations)
        # index T: the bootstrap value V(s_T) from the last chunk's terminal inference
        np.testing.assert_array_equal(tr.prev_values[e, T], env_part(T - 1, e).final_values)
    chex.assert_shape(tr.obs["image"], (E, T, B, 2, 2, 3))
    chex.assert_shape(tr.rewards, (E, T, B, K))
    chex.assert_shape([tr.dones, tr.terminations, tr.truncations], (E, T + 1, B))
    chex.assert_type(tr.dones, bool)
    chex.assert_shape(tr.prev_values, (E, T + 1, B))
    assert int(tr.step_id) == 0 and int(tr.env_rank) == 0


def test_collect_transitions_resolves_next_obs():
    plan = TrajectoryPlan(
        num_chunks=T, num_epochs=E, batch_size=B, num_env_ranks=2, collect_transitions=True
    )
    override = {k: v + 1 for k, v in policy_part(T - 1).obs.items()}
    c = jaxtraj.TrajectoryCollector(plan, policy_part(0), env_part(0))
    with pytest.raises(CollectorError, match="next_obs"):
        c.add(env_part(T - 1))
    out = []
    for p in all_parts():
        if isinstance(p, jaxtraj.EnvPart) and int(p.source.key.chunk_id) in (0, T - 1):
            p = p.replace(next_obs=override)  # a boundary override mid-epoch, and the last
        out += c.add(p)
    tr = out[0][1]
    for e in range(E):
        np.testing.assert_array_equal(tr.next_obs["state"][e, 0], override["state"])
        np.testing.assert_array_equal(tr.next_obs["state"][e, 1], policy_part(2, e).obs["state"])
        np.testing.assert_array_equal(tr.next_obs["state"][e, T - 1], override["state"])
    # Off, transitions take no memory at all.
    assert jaxtraj.init(PLAN, policy_part(0), env_part(0)).env.next_obs is None


def test_interventions_replace_executed_actions():
    p, v = policy_part(0), env_part(0)
    flags = np.zeros((B, K), bool)
    flags[1, 0] = True
    human = np.full((B, K * A), 99.0, np.float32)
    tr = v.transition.replace(intervene_actions=human, intervene_flags=flags)
    step = TrajectoryStep.from_parts(p, v.replace(transition=tr))
    expect = np.array(p.output.actions)
    expect[1, 0] = 99.0
    np.testing.assert_array_equal(step.actions, expect)
    chex.assert_shape(step.intervene_flags, expect.shape)
    assert int(step.intervene_flags.sum()) == A


def _truncated_pair():
    """A pair whose chunk bootstraps: row 1 truncated, final values given."""
    p, v = policy_part(1), env_part(1)
    trunc = np.zeros((B,), bool)
    trunc[1] = True
    rm = np.ones_like(v.transition.rewards)  # a reward model: the weights apply to it
    return p, v.replace(transition=v.transition.replace(truncations=trunc, reward_model_output=rm))


def test_from_parts_without_a_plan_uses_the_plans_defaults():
    p, v = _truncated_pair()
    bare = TrajectoryStep.from_parts(p, v)
    assert_same(bare, TrajectoryStep.from_parts(p, v, TrajectoryPlan(num_chunks=1)))
    # The reward weights make the plan visible: another weight gives other rewards.
    other = TrajectoryStep.from_parts(p, v, TrajectoryPlan(num_chunks=1, env_reward_weight=0.5))
    assert not np.array_equal(bare.rewards, other.rewards)
    # The rewards are the environment's: the truncation bootstrap is the targets' business.
    np.testing.assert_array_equal(bare.rewards, v.transition.rewards + v.transition.reward_model_output)


def test_from_parts_without_a_plan_follows_the_plan_defaults_when_they_change(monkeypatch):
    """Defect 7: the defaults are TrajectoryPlan's, not a second copy of them."""
    import jaxtraj.types

    p, v = _truncated_pair()
    want = TrajectoryStep.from_parts(p, v, TrajectoryPlan(num_chunks=1, env_reward_weight=0.5))
    patched = functools.partial(TrajectoryPlan, env_reward_weight=0.5)  # a moved default
    monkeypatch.setattr(jaxtraj.types, "TrajectoryPlan", patched)
    assert_same(TrajectoryStep.from_parts(p, v), want)


def test_chunk_size_from_the_action_chunk():
    tr = env_part(0).transition
    assert chunk_size(np.zeros((B, K, A)), None) == K
    assert chunk_size(np.zeros((B, K, A)), tr) == K
    # Flat actions [B, K*A]: K from the action-level rewards, else one action per chunk.
    assert chunk_size(np.zeros((B, K * A)), tr) == K
    assert chunk_size(np.zeros((B, K * A)), EnvTransition(rewards=np.zeros((B,)))) == 1
    # Leading buffer axes [E, T, B, ...]: per-row axes start at `start`.
    assert chunk_size(np.zeros((E, T, B, K, A)), None, start=3) == K


@pytest.mark.parametrize("field", ["rewards", "terminations", "intervene_flags"])
def test_chunk_size_rejects_a_field_with_another_k(field):
    wrong = np.zeros((B, K + 1), bool if field != "rewards" else np.float32)
    tr = env_part(1).transition.replace(**{field: wrong})
    with pytest.raises(CollectorError, match=f"EnvTransition.{field}") as info:
        chunk_size(np.zeros((B, K, A)), tr)
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH


def test_cut_flags_say_which_flags_cut_an_episode():
    term = np.array([True, False, False, False])
    trunc = np.array([False, True, False, False])
    tr = EnvTransition(rewards=np.zeros((B,), np.float32), terminations=term, truncations=trunc)
    np.testing.assert_array_equal(tr.cut_flags("truncated", np), trunc)
    np.testing.assert_array_equal(tr.cut_flags("done", np), term | trunc)
    assert tr.cut_flags("none", np) is None
    dones = np.array([False, False, True, False])
    np.testing.assert_array_equal(tr.replace(dones=dones).cut_flags("done", np), dones)
    # No flags at all: nothing cuts, under every setting (defect 1).
    bare = EnvTransition(rewards=np.ones((B,), np.float32))
    for bootstrap in ("truncated", "done", "none"):
        assert bare.cut_flags(bootstrap, np) is None
        np.testing.assert_array_equal(
            bare.chunk_rewards(bare.rewards, np.full((B,), 5.0, np.float32), bootstrap=bootstrap),
            bare.rewards,
        )


def test_chunk_rewards_bootstrap_exactly_the_cut_flags():
    r = np.arange(B, dtype=np.float32)
    term = np.array([True, False, False, False])
    trunc = np.array([False, True, False, False])
    v = np.full((B,), 10.0, np.float32)
    tr = EnvTransition(rewards=r, terminations=term, truncations=trunc)
    np.testing.assert_array_equal(tr.compute_rewards(), r)  # no bootstrap in composition
    for bootstrap in ("truncated", "done", "none"):
        cut = tr.cut_flags(bootstrap, np)
        want = r + (0.5 * v * cut if cut is not None else 0)
        got = tr.chunk_rewards(r, v, gamma=0.5, bootstrap=bootstrap)
        np.testing.assert_allclose(got, want)


def test_owned_actions_end_at_the_first_end_and_skip_what_did_not_run():
    dones = np.array([[False, True, False, True], [False, False, False, False],
                      [True, False, False, False], [False, False, False, False]])
    valid = np.array([[True, True, False, True], [True] * 4, [True, False, False, False],
                      [False, True, True, True]])
    tr = EnvTransition(rewards=np.zeros((B, 4), np.float32), terminations=dones,
                       truncations=np.zeros_like(dones))
    np.testing.assert_array_equal(tr.owned_actions(xp=np), [[1, 1, 0, 0], [1] * 4, [1, 0, 0, 0],
                                                           [1] * 4])
    np.testing.assert_array_equal(tr.replace(valid_actions=valid).owned_actions(xp=np),
                                  [[1, 1, 0, 0], [1] * 4, [1, 0, 0, 0], [0, 1, 1, 1]])
    # Chunk-level flags and rewards: every action is owned.
    assert EnvTransition(rewards=np.zeros((B,)), terminations=dones[:, 0]).owned_actions() is None
