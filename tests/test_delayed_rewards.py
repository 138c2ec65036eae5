"""Delayed reward-model rewards (issue 27, item 1): ``EnvTransition.reward_assign_lengths``.

A chunk's weighted reward-model score also goes to the rewards of the ``length - 1`` chunks
of its env before it in the training step, cut to the chunks held. Checked against values
worked out by hand and against a plain Python loop written here, through the facade, the
pure functions under ``jit``, fragments in a shuffled order, pipeline and lerobot modes
and a checkpoint; bad lengths are refused naming the field.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from helpers import collect_jit, collect_one

import jaxtraj
from jaxtraj import EnvPart, EnvTransition, PolicyPart

T, B, K = 4, 2, 2
NO = np.zeros((B,), bool)
W_RM = 2.0
PLAN = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B, truncation_bootstrap="none",
                              reward_model_weight=W_RM)
ENV_R = np.ones((T, B), np.float32)
# Row 0: chunk 1 scored 1 with length 1 (nothing back), chunk 3 scored 5 with length 2 (one
# chunk back). Row 1: chunk 3 scored 3 with length 10, more than the 3 chunks before it.
RM = np.array([[0, 0], [1, 0], [0, 0], [5, 3]], np.float32)
LENGTHS = np.array([[0, 0], [1, 0], [0, 0], [2, 10]], np.int32)
# By hand: 1 + 2 * rm on every chunk, then row 0's chunk 2 gets 2 * 5 and row 1's chunks
# 0, 1, 2 get 2 * 3 each.
BY_HAND = np.array([[1, 7], [3, 7], [11, 7], [11, 7]], np.float32)


def reference(env_r, rm, lengths, w_env=1.0, w_rm=W_RM):
    """A plain loop: compose each chunk's reward, then walk each scored chunk's history
    back, chunk by chunk, within the epoch ([E, T, B(, K)] or [T, B(, K)])."""
    env_r, rm, lengths = (np.array(x, np.float64) for x in (env_r, rm, lengths))
    out = w_env * env_r + w_rm * rm
    squeeze = lengths.ndim == 2  # [T, B]: one epoch
    if squeeze:
        out, rm, lengths = out[None], rm[None], lengths[None]
    for e in range(out.shape[0]):
        for t in range(out.shape[1]):
            for b in range(out.shape[2]):
                for back in range(1, int(lengths[e, t, b])):
                    if t - back < 0:
                        break
                    out[e, t - back, b] += w_rm * rm[e, t, b]
    return out[0] if squeeze else out


def parts(rm=RM, lengths=LENGTHS, env_r=ENV_R, epochs=1, valid=None):
    """Both halves of every chunk of every epoch, a reward model on every chunk (zero
    where it did not score) and its assign lengths."""
    out = []
    for e in range(epochs):
        for t in range(T):
            out.append(PolicyPart.at(
                chunk_id=t, epoch_id=e,
                obs=(10 * t + np.arange(B, dtype=np.float32))[:, None],
                actions=np.zeros((B, K, 1), np.float32),
                prev_values=np.zeros((B,), np.float32),
            ))
            r = np.asarray(env_r[e][t] if epochs > 1 else env_r[t])
            flags = np.zeros(r.shape, bool)  # [B] or [B, K], like the rewards
            out.append(EnvPart.at(
                chunk_id=t, epoch_id=e,
                rewards=r,
                terminations=flags,
                truncations=flags,
                reward_model_output=np.asarray(rm[e][t] if epochs > 1 else rm[t]),
                reward_assign_lengths=np.asarray(
                    lengths[e][t] if epochs > 1 else lengths[t], np.int32),
                valid_actions=None if valid is None else valid[t],
                initial_transition=EnvTransition(terminations=flags, truncations=flags)
                if t == 0 else None,
                final_values=np.zeros((B,), np.float32) if t == T - 1 else None,
            ))
    return out


facade, pure = collect_one, collect_jit


def test_the_reference_gives_the_hand_values():
    np.testing.assert_array_equal(reference(ENV_R, RM, LENGTHS), BY_HAND)


@pytest.mark.parametrize("run", [facade, pure], ids=["facade", "jit"])
def test_spread_over_one_two_and_more_than_the_held_chunks(run):
    np.testing.assert_allclose(np.asarray(run(PLAN, parts()).rewards)[0], BY_HAND)


@pytest.mark.parametrize("run", [facade, pure], ids=["facade", "jit"])
def test_without_lengths_nothing_is_assigned_back(run):
    ps = [p.replace(transition=p.transition.replace(reward_assign_lengths=None))
          if isinstance(p, EnvPart) else p for p in parts()]
    np.testing.assert_allclose(np.asarray(run(PLAN, ps).rewards)[0], ENV_R + W_RM * RM)


def test_random_lengths_against_the_loop():
    """Random scores and lengths (0 .. T + 2), two epochs (a history stops at its epoch's
    first chunk), the original's env_reward_weight = 0, under jit."""
    rng = np.random.default_rng(3)
    E = 2
    plan = dataclasses.replace(PLAN, num_epochs=E, env_reward_weight=0.0)
    env_r = rng.normal(size=(E, T, B)).astype(np.float32)
    rm = rng.normal(size=(E, T, B)).astype(np.float32)
    lengths = rng.integers(0, T + 3, size=(E, T, B)).astype(np.int32)
    want = reference(env_r, rm, lengths, w_env=0.0)
    ps = parts(rm, lengths, env_r, epochs=E)
    for run in (pure, facade):
        np.testing.assert_allclose(np.asarray(run(plan, ps).rewards), want, rtol=1e-5, atol=1e-5)


def test_per_action_scores_and_a_cut_chunk():
    """Per-action rewards and scores [B, K]: each action of a history chunk gets the score of
    the same action; an action that did not run (valid_actions) gets nothing."""
    rng = np.random.default_rng(5)
    env_r = rng.normal(size=(T, B, K)).astype(np.float32)
    rm = rng.normal(size=(T, B, K)).astype(np.float32)
    lengths = np.array([[0, 0], [2, 0], [0, 3], [4, 2]], np.int32)
    valid = np.ones((T, B, K), bool)
    valid[1, 0, 1] = False  # row 0's episode ends at chunk 1, action 0: action 1 cut
    env_r[1, 0, 1] = 0.0
    rm[1, 0, 1] = 0.0
    ps = parts(rm, lengths, env_r, valid=valid)
    ends = np.zeros((T, B, K), bool)
    ends[1, 0, 0] = True
    ps = [p.replace(transition=p.transition.replace(terminations=ends[p.source.key.chunk_id]))
          if isinstance(p, EnvPart) else p for p in ps]
    want = np.where(valid, reference(env_r, rm, lengths), 0.0)
    for run in (facade, pure):
        traj = run(PLAN, ps)
        np.testing.assert_allclose(np.asarray(traj.rewards)[0], want, rtol=1e-5, atol=1e-6)
        assert np.asarray(traj.rewards)[0, 1, 0, 1] == 0.0  # the cut action: nothing


def test_fragments_in_shuffled_order():
    ps = parts()
    frags = [f for p in ps for f in p.split([1, 1])]
    order = np.random.default_rng(11).permutation(len(frags))
    shuffled = [frags[i] for i in order]
    np.testing.assert_allclose(np.asarray(facade(PLAN, shuffled, ps[:2]).rewards)[0], BY_HAND)
    np.testing.assert_allclose(np.asarray(pure(PLAN, shuffled, ps[:2]).rewards)[0], BY_HAND)
    merged = EnvPart.merge(frags[3:1:-1])
    np.testing.assert_array_equal(merged.transition.reward_assign_lengths, LENGTHS[0])


def test_pipeline_mode():
    plan = dataclasses.replace(PLAN, mode="pipeline", normalize_advantages=False,
                               advantage="returns")
    ps = parts()
    c = jaxtraj.TrajectoryCollector(plan, ps[0], ps[1], rng=jax.random.PRNGKey(0))
    out = []
    for p in ps[::-1]:  # the last chunk (the scores) first
        out += c.add(p)
    ((_, mb),) = out
    tags = np.asarray(mb.obs).reshape(-1).astype(int)  # 10 * t + row of each sample
    rewards = np.asarray(mb.rewards).reshape(-1)
    keep = np.asarray(mb.loss_mask).reshape(-1)
    got = {int(tag): float(r) for tag, r, k in zip(tags, rewards, keep) if k}
    assert got == {10 * t + b: float(BY_HAND[t, b]) for t in range(T) for b in range(B)}


def test_lerobot_frames_record_the_assigned_rewards():
    plan = dataclasses.replace(PLAN, mode="lerobot", lerobot_frame="chunk",
                               max_episode_length=16)
    ps = []
    for p in parts():
        if isinstance(p, EnvPart):
            t = p.source.key.chunk_id
            ends = np.ones((B,), bool) if t == T - 1 else NO
            p = p.replace(transition=p.transition.replace(terminations=ends))
        ps.append(p)
    c = jaxtraj.TrajectoryCollector(plan, ps[0], ps[1], tasks="t")
    items = []
    for p in ps:
        items += c.add(p)
    episodes = {b: f for _, eps in items for b, f in eps}
    for b in range(B):
        np.testing.assert_allclose(np.asarray(episodes[b]["next.reward"]).reshape(-1),
                                   BY_HAND[:, b])


def test_checkpoint_round_trip(tmp_path):
    from jaxtraj import checkpoint

    ps = parts()
    c = jaxtraj.TrajectoryCollector(PLAN, ps[0], ps[1])
    for p in ps[:-1]:
        c.add(p)
    checkpoint.save(c, tmp_path / "ckpt")
    back = checkpoint.restore(tmp_path / "ckpt", PLAN, ps[0], ps[1])
    ((_, traj),) = back.add(ps[-1])
    np.testing.assert_allclose(np.asarray(traj.rewards)[0], BY_HAND)


# -- bad input --------------------------------------------------------------------------------


def with_lengths(p, lengths, rm="keep"):
    tr = p.transition.replace(reward_assign_lengths=lengths)
    if rm is None:
        tr = tr.replace(reward_model_output=None)
    return p.replace(transition=tr)


def test_a_negative_length_is_refused_naming_the_rows_and_nothing_is_lost():
    ps = parts()
    bad = with_lengths(ps[3], np.array([1, -2], np.int32))
    c = jaxtraj.TrajectoryCollector(PLAN, ps[0], ps[1])
    c.add(ps[0])
    with pytest.raises(jaxtraj.CollectorError,
                       match=r"reward_assign_lengths rows \[1\]: -2") as info:
        c.add(bad)
    assert info.value.code == jaxtraj.ErrorCode.INVALID_REWARD_ASSIGN
    assert info.value.key == (0, 0, 0, 0, 1)
    with pytest.raises(jaxtraj.CollectorError, match="INVALID_REWARD_ASSIGN"):  # batched
        c.add_many([bad])
    out = []
    for p in ps[1:]:
        out += c.add(p)
    np.testing.assert_allclose(np.asarray(out[0][1].rewards)[0], BY_HAND)
    # The pure function records the code; the state's data is untouched.
    state = jaxtraj.init(PLAN, ps[0], ps[1])
    state = jax.jit(jaxtraj.add_env, static_argnums=0)(PLAN, state, bad)
    with pytest.raises(jaxtraj.CollectorError, match="INVALID_REWARD_ASSIGN"):
        jaxtraj.raise_if_error(state)
    assert not np.asarray(state.env_rows).any()


BAD = [
    (np.array([1, 2], np.int32), None, "reward_assign_lengths without reward_model_output"),
    (np.array([1.0, 2.0], np.float32), "keep", r"must be integer \(rows,\).*got float32 \(2,\)"),
    (np.array([[1], [2]], np.int32), "keep", r"must be integer \(rows,\).*got int32 \(2, 1\)"),
]


@pytest.mark.parametrize("lengths,rm,match", BAD, ids=["no reward model", "float", "shape"])
def test_a_bad_example_is_refused_at_init_naming_the_field(lengths, rm, match):
    ps = parts()
    bad = with_lengths(ps[3], lengths, rm)
    with pytest.raises(jaxtraj.CollectorError, match=match) as info:
        jaxtraj.init(PLAN, ps[0], bad)
    assert info.value.code == jaxtraj.ErrorCode.STRUCTURE_MISMATCH
    with pytest.raises(jaxtraj.CollectorError, match=match):
        jaxtraj.TrajectoryCollector(PLAN, ps[0], bad)


@pytest.mark.parametrize("lengths,rm,match", [
    (BAD[0][0], None, r"missing \.transition\.reward_model_output"),
    (BAD[1][0], "keep", r"reward_assign_lengths: got shape \(2,\) dtype float32"),
    (BAD[2][0], "keep", r"reward_assign_lengths: got shape \(2, 1\) dtype int32"),
], ids=["no reward model", "float", "shape"])
def test_a_half_unlike_the_example_is_a_structure_mismatch_naming_the_field(lengths, rm, match):
    ps = parts()
    bad = with_lengths(ps[3], lengths, rm)
    c = jaxtraj.TrajectoryCollector(PLAN, ps[0], ps[1])
    with pytest.raises(jaxtraj.CollectorError, match=match) as info:
        c.add(bad)
    assert info.value.code == jaxtraj.ErrorCode.STRUCTURE_MISMATCH
    state = jaxtraj.init(PLAN, ps[0], ps[1])
    with pytest.raises(jaxtraj.CollectorError, match=match):
        jax.jit(jaxtraj.add_env, static_argnums=0)(PLAN, state, bad)
    out = [item for p in ps for item in c.add(p)]  # nothing lost
    np.testing.assert_allclose(np.asarray(out[0][1].rewards)[0], BY_HAND)
