"""The original collector's reward and intervention semantics (issue 27): the reward-weight
rule, and model-side intervention flags, against hand-computed values."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from helpers import collect_jit, collect_one

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


facade, pure = collect_one, collect_jit


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


# -- model-side intervention flags -------------------------------------------------------------

A = 2  # action dimensions: actions [B, K, A]
HUMAN = 99.0
F, Tr = False, True
# Model-side flags per chunk, [T, B, K]: what the policy side reports it corrected itself.
MODEL_K = np.array([[[Tr, F], [F, F]], [[F, F], [F, Tr]]])
MODEL_ROW = np.array([[Tr, F], [F, F]])  # [T, B]: every action of the row's chunk
# Env-side flags [T, B, K], with the human's actions HUMAN.
ENV_K = np.array([[[F, Tr], [F, F]], [[F, F], [F, Tr]]])


def actions(t):
    """[B, K, A] policy actions that encode (t, row, action, dim)."""
    return (
        100 * t + 10 * np.arange(B)[:, None, None] + np.arange(K)[None, :, None]
        + np.arange(A)[None, None, :] / 10
    ).astype(np.float32)


def iparts(model=None, env=None, flat=False):
    """Both halves of every chunk; ``model`` [T, B(, K)] model-side flags, ``env`` [T, B, K]
    env-side flags (with human actions), ``flat``: actions [B, K*A] with action-level
    rewards (so K is stated)."""
    out = []
    for t in range(T):
        a = actions(t).reshape(B, -1) if flat else actions(t)
        out.append(
            PolicyPart.at(
                chunk_id=t,
                obs=(10 * t + np.arange(B, dtype=np.float32))[:, None],  # encodes (t, row)
                actions=a,
                prev_logprobs=np.zeros(a.shape, np.float32),
                prev_values=np.zeros((B,), np.float32),
                intervene_flags=None if model is None else np.asarray(model[t]),
            )
        )
        human = {}
        if env is not None:
            human = dict(intervene_actions=np.full((B, K * A), HUMAN, np.float32),
                         intervene_flags=np.asarray(env[t]))
        out.append(
            EnvPart.at(
                chunk_id=t,
                rewards=np.ones((B, K), np.float32) if flat else ENV_R[t],
                terminations=NO,
                truncations=NO,
                initial_transition=EnvTransition(terminations=NO, truncations=NO) if t == 0 else None,
                final_values=np.zeros((B,), np.float32) if t == T - 1 else None,
                **human,
            )
        )
    return out


def expected(model=None, env=None):
    """By hand: actions [T, B, K, A] (the human's where env flags say) and the flags, per
    action element, env or model."""
    acts = np.stack([actions(t) for t in range(T)])
    flags = np.zeros((T, B, K), bool)
    if env is not None:
        acts = np.where(np.asarray(env)[..., None], HUMAN, acts)
        flags |= env
    if model is not None:
        m = np.asarray(model)
        flags |= m if m.ndim == 3 else np.repeat(m[..., None], K, axis=2)
    return acts, np.repeat(flags[..., None], A, axis=3)


CASES = [
    ("model [B, K]", MODEL_K, None),
    ("model [B]", MODEL_ROW, None),
    ("env", None, ENV_K),
    ("both", MODEL_K, ENV_K),
    ("both, model [B]", MODEL_ROW, ENV_K),
]


def check(traj, model, env):
    want_actions, want_flags = expected(model, env)
    got_actions = np.asarray(traj.actions)[0].reshape(want_actions.shape)
    np.testing.assert_array_equal(got_actions, want_actions)
    assert traj.intervene_flags.shape == traj.actions.shape
    np.testing.assert_array_equal(
        np.asarray(traj.intervene_flags)[0].reshape(want_flags.shape), want_flags
    )


def test_the_hand_computed_values_themselves():
    """The expectation, spelled out for 'both': chunk 0 row 0 flags action 0 (model) and
    action 1 (env, human action), chunk 1 row 1 action 1 (both)."""
    acts, flags = expected(MODEL_K, ENV_K)
    assert flags[..., 0].tolist() == [[[Tr, Tr], [F, F]], [[F, F], [F, Tr]]]
    assert acts[0, 0, 0].tolist() == pytest.approx([0.0, 0.1])  # model-flagged: the policy's
    assert acts[0, 0, 1].tolist() == [HUMAN, HUMAN]
    assert acts[1, 1, 1].tolist() == [HUMAN, HUMAN]


@pytest.mark.parametrize("run", [facade, pure], ids=["facade", "jit"])
@pytest.mark.parametrize("name,model,env", CASES, ids=[c[0] for c in CASES])
def test_model_and_env_flags(run, name, model, env):
    check(run(PLAN, iparts(model, env)), model, env)


def test_from_parts_directly_and_flat_actions():
    ps = iparts(MODEL_K, ENV_K)
    step = jaxtraj.TrajectoryStep.from_parts(ps[0], ps[1])
    want_actions, want_flags = expected(MODEL_K, ENV_K)
    np.testing.assert_array_equal(step.actions, want_actions[0])
    np.testing.assert_array_equal(step.intervene_flags, want_flags[0])
    # Flat actions [B, K*A]: K from the action-level rewards, each action's A elements.
    for model in (MODEL_K, MODEL_ROW):
        traj = facade(PLAN, iparts(model, ENV_K, flat=True))
        check(traj, model, ENV_K)
    # No flags anywhere: none recorded.
    assert facade(PLAN, iparts()).intervene_flags is None


@pytest.mark.parametrize("name,model,env", CASES[::3], ids=[c[0] for c in CASES[::3]])
def test_fragments_in_shuffled_order(name, model, env):
    """PolicyPart.split / EnvPart.split into one-row fragments, added in a shuffled order,
    through the facade and the jitted pure functions; merge restores the halves."""
    ps = iparts(model, env)
    frags = [f for p in ps for f in p.split([1, 1])]
    order = np.random.default_rng(7).permutation(len(frags))
    shuffled = [frags[i] for i in order]
    c = jaxtraj.TrajectoryCollector(PLAN, ps[0], ps[1])
    out = []
    for f in shuffled:
        out += c.add(f)
    check(out[0][1], model, env)
    check(pure(PLAN, shuffled), model, env)
    merged = PolicyPart.merge(frags[1::-1])
    np.testing.assert_array_equal(merged.output.intervene_flags, ps[0].output.intervene_flags)


def test_pipeline_mode_flush():
    """Pipeline mode takes the flags' halves and flushes; env-side flags replace the
    micro-batches' actions, model-side ones never do."""
    plan = dataclasses.replace(PLAN, mode="pipeline", normalize_advantages=False)
    want_actions, _ = expected(MODEL_K, ENV_K)
    ps = iparts(MODEL_K, ENV_K)
    c = jaxtraj.TrajectoryCollector(plan, ps[0], ps[1], rng=jax.random.PRNGKey(0))
    out = []
    for p in ps[::-1]:
        out += c.add(p)
    ((_, mb),) = out
    tags = np.asarray(mb.obs).reshape(-1).astype(int)  # 10 * t + row of each sample
    got = np.asarray(mb.actions).reshape((-1, K, A))
    assert sorted(tags) == [0, 1, 10, 11]
    for i, tag in enumerate(tags):
        np.testing.assert_array_equal(got[i], want_actions[tag // 10, tag % 10])


LEROBOT = dataclasses.replace(PLAN, mode="lerobot", max_episode_length=8)


def per_action_obs(ps, end=False):
    """Env halves with per-action observations (lerobot mode's frames need them);
    ``end``: every env's episode ends with the last chunk."""
    out = []
    for p in ps:
        if isinstance(p, EnvPart):
            t = p.source.key.chunk_id
            p = p.replace(action_obs=np.full((B, K, 1), t, np.float32))
            if end and t == T - 1:
                p = p.replace(transition=p.transition.replace(terminations=np.ones((B,), bool)))
        out.append(p)
    return out


def test_lerobot_intervention_frames_record_model_flags():
    ps = per_action_obs(iparts(MODEL_K, ENV_K), end=True)
    want = expected(MODEL_K, ENV_K)[1][..., 0]  # [T, B, K]
    # The pure functions, under jit, and the trajectory's frames.
    traj = pure(LEROBOT, ps)
    frames, _, _ = jaxtraj.types.trajectory_frames(traj, per_action=True, actions_per_chunk=K)
    flags = np.asarray(frames["intervention"])[..., 0]  # [T*K, B], time-ordered
    np.testing.assert_array_equal(flags, want.transpose(0, 2, 1).reshape(T * K, B))
    # The facade's lerobot mode: each env's episode carries them, frame by frame.
    c = jaxtraj.TrajectoryCollector(LEROBOT, ps[0], ps[1], tasks="t")
    items = []
    for p in ps:
        items += c.add(p)
    episodes = {b: f for _, eps in items for b, f in eps}
    for b in range(B):
        np.testing.assert_array_equal(
            np.asarray(episodes[b]["intervention"]).reshape(-1), want[:, b].reshape(-1)
        )


def test_an_expert_half_gets_false_flags_in_lerobot_mode():
    plan = LEROBOT
    ps = per_action_obs(iparts(MODEL_K), end=True)
    expert = ps[2].replace(output=jaxtraj.PolicyOutput(actions=ps[2].output.actions))
    layout = jaxtraj.init(plan, ps[0], ps[1]).policy.output
    assert expert.missing_outputs(layout) == ["prev_logprobs", "prev_values", "intervene_flags"]
    # An inferred half lacking only the flags is not an expert's: a structure mismatch.
    assert ps[2].replace(output=ps[2].output.replace(intervene_flags=None)).missing_outputs(
        layout) == []
    filled = expert.as_expert(layout, lead=2)
    np.testing.assert_array_equal(filled.output.intervene_flags, np.zeros((B, K), bool))
    want = np.stack([MODEL_K[0], np.zeros((B, K), bool)])  # [T, B, K]: the expert's False
    traj = pure(plan, [ps[0], ps[1], expert, ps[3]])
    np.testing.assert_array_equal(np.asarray(traj.intervene_flags)[0, :, :, :, 0], want)
    c = jaxtraj.TrajectoryCollector(plan, ps[0], ps[1], tasks="t")
    items = []
    for p in [ps[0], ps[1], expert, ps[3]]:
        items += c.add(p)
    episodes = {b: f for _, eps in items for b, f in eps}
    for b in range(B):
        np.testing.assert_array_equal(
            np.asarray(episodes[b]["intervention"]).reshape(-1), want[:, b].reshape(-1)
        )


def test_checkpoint_round_trip(tmp_path):
    from jaxtraj import checkpoint

    ps = iparts(MODEL_K, ENV_K)
    c = jaxtraj.TrajectoryCollector(PLAN, ps[0], ps[1])
    for p in ps[:3]:
        c.add(p)
    checkpoint.save(c, tmp_path / "ckpt")
    back = checkpoint.restore(tmp_path / "ckpt", PLAN, ps[0], ps[1])
    out = back.add(ps[3])
    check(out[0][1], MODEL_K, ENV_K)


BAD = [
    ("shape", np.zeros((B, K + 1), bool)),
    ("dtype", np.zeros((B, K), np.int32)),
    ("per row for a per-action plan", np.zeros((B,), bool)),
]


@pytest.mark.parametrize("name,flags", BAD, ids=[b[0] for b in BAD])
def test_wrong_shape_or_dtype_is_a_structure_mismatch_naming_the_field(name, flags):
    ps = iparts(MODEL_K)
    bad = ps[2].replace(output=ps[2].output.replace(intervene_flags=flags))
    c = jaxtraj.TrajectoryCollector(PLAN, ps[0], ps[1])
    c.add(ps[0])
    with pytest.raises(jaxtraj.CollectorError, match="intervene_flags") as info:
        c.add(bad)
    assert info.value.code == jaxtraj.ErrorCode.STRUCTURE_MISMATCH
    assert info.value.key == (0, 0, 0, 0, 1)
    out = []
    for p in ps[1:]:  # nothing lost
        out += c.add(p)
    check(out[0][1], MODEL_K, None)
    # The pure function, at trace time.
    state = jaxtraj.init(PLAN, ps[0], ps[1])
    with pytest.raises(jaxtraj.CollectorError, match="intervene_flags") as info:
        jax.jit(jaxtraj.add_policy, static_argnums=0)(PLAN, state, bad)
    assert info.value.code == jaxtraj.ErrorCode.STRUCTURE_MISMATCH


def test_a_half_without_the_plans_flags_or_with_flags_the_plan_lacks():
    ps, plain = iparts(MODEL_K), iparts()
    for example, part, what in ((ps, plain[2], "missing"), (plain, ps[2], "not in the plan")):
        c = jaxtraj.TrajectoryCollector(PLAN, example[0], example[1])
        with pytest.raises(jaxtraj.CollectorError, match=f"{what}.*intervene_flags") as info:
            c.add(part)
        assert info.value.code == jaxtraj.ErrorCode.STRUCTURE_MISMATCH


@pytest.mark.parametrize(
    "flags", [np.zeros((B, K), np.int32), np.zeros((B, K + 1), bool), np.zeros((B, 3), bool)]
)
def test_a_bad_example_is_named_at_init(flags):
    """An example whose flags are not bool or do not fit the action chunk: refused when
    the state is allocated, naming the field, before anything is collected."""
    ps = iparts(MODEL_K, flat=True)  # flat actions [B, K*A = 4]: [B, 3] does not split them
    ps = [p.replace(output=p.output.replace(intervene_flags=flags))
          if isinstance(p, PolicyPart) else p for p in ps]
    with pytest.raises(jaxtraj.CollectorError, match="PolicyOutput.intervene_flags") as info:
        jaxtraj.init(PLAN, ps[0], ps[1])
    assert info.value.code == jaxtraj.ErrorCode.STRUCTURE_MISMATCH
    with pytest.raises(jaxtraj.CollectorError, match="PolicyOutput.intervene_flags"):
        jaxtraj.TrajectoryCollector(PLAN, ps[0], ps[1])
