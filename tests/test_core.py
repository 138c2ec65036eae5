"""The core: data types, keyed join, rollout flush, facade."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PLAN, B, E, K, T, all_parts, env_part, policy_part

import jaxtraj
from jaxtraj import CollectorError


def reference(env_rank=0, step=0):
    """Trajectory from a clean collector fed in order, one part at a time."""
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), step_id=step)
    out = []
    for p in all_parts(env_rank, step):
        out += c.add(p)
    assert len(out) == 1
    return out[0][1]


def assert_same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def snapshot(state):
    return jax.tree.map(lambda x: np.array(x, copy=True), state)


def test_public_names():
    assert sorted(jaxtraj.__all__) == sorted(
        [
            "CollectorError",
            "CollectorState",
            "EnvPart",
            "EnvTransition",
            "ErrorCode",
            "MicroBatches",
            "PolicyInput",
            "PolicyOutput",
            "PolicyPart",
            "Targets",
            "Trajectory",
            "TrajectoryCollector",
            "TrajectoryKey",
            "TrajectoryPlan",
            "TrajectorySource",
            "TrajectoryStep",
            "add_env",
            "add_envs",
            "add_policies",
            "add_policy",
            "discounted_returns",
            "gae",
            "gae_from_next_values",
            "group_advantages",
            "init",
            "lerobot",
            "materialize",
            "normalize_advantages",
            "pipeline",
            "raise_if_error",
            "rollout",
            "slot_complete",
            "source_complete",
            "stack_parts",
            "trajectory_targets",
        ]
    )
    for name in jaxtraj.__all__:
        assert getattr(jaxtraj, name) is not None
    # The names the README and the examples use, mode by mode.
    for name in ("flush", "ready", "Rollout"):
        assert callable(getattr(jaxtraj.rollout, name))
    for name in ("flush", "init", "make_flush", "shard_state", "ready", "Pipeline"):
        assert callable(getattr(jaxtraj.pipeline, name))
    for name in ("LeRobotWriter", "features"):
        assert callable(getattr(jaxtraj.lerobot, name))
    from jaxtraj.runners import sync, threads

    for name in ("make_collect", "reset", "example_parts"):
        assert callable(getattr(sync, name))
    for name in ("AsyncRunner", "DecoupledRunner", "RunnerError"):
        assert callable(getattr(threads, name))


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
    assert tr.obs["image"].shape == (E, T, B, 2, 2, 3)
    assert tr.rewards.shape == (E, T, B, K)
    assert tr.dones.shape == (E, T + 1, B) and tr.dones.dtype == bool
    assert tr.prev_values.shape == (E, T + 1, B)
    assert int(tr.step_id) == 0 and int(tr.env_rank) == 0


def test_sources_flush_independently_and_buffers_clear():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    got = []
    parts0, parts1 = all_parts(0), all_parts(1)
    for p in parts1[:-1]:
        assert c.add(p) == []
    for p in parts0:
        got += c.add(p)
    assert [int(t.env_rank) for _, t in got] == [0]
    assert c.ready() == []
    # source 0 is on step 1 now; source 1 is still on step 0
    assert c.current_step(0) == 1 and c.current_step(1) == 0
    got += c.add(parts1[-1])
    for p in all_parts(0, step=1):
        got += c.add(p)
    assert [(int(t.env_rank), int(t.step_id)) for _, t in got] == [(0, 0), (1, 0), (0, 1)]
    assert_same(got[0][1], reference(0))
    assert_same(got[1][1], reference(1))
    assert_same(got[2][1], reference(0, step=1))


def test_split_merge_round_trip():
    p = policy_part(1)
    frags = p.split([1, 2, 1])
    assert [int(f.source.offset) for f in frags] == [0, 1, 3]
    assert frags[1].obs["state"].shape == (2, 5)
    assert_same(jaxtraj.PolicyPart.merge(frags[::-1]), p)
    v = env_part(0)
    assert_same(jaxtraj.EnvPart.merge(v.split([3, 1])), v)
    with pytest.raises(ValueError, match="contiguous"):
        jaxtraj.PolicyPart.merge([frags[0], frags[2]])


def test_add_many_equals_one_at_a_time():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    parts = all_parts(0) + all_parts(1)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(parts))
    out = c.add_many([parts[i] for i in order[:10]])
    out += c.add_many([parts[i] for i in order[10:]])
    assert sorted(int(t.env_rank) for _, t in out) == [0, 1]
    for _, t in out:
        assert_same(t, reference(int(t.env_rank)))


def test_no_retrace_on_repeated_inserts():
    traces = {"policy": 0, "env": 0}

    def add_policy(plan, state, part):
        traces["policy"] += 1
        return jaxtraj.add_policy(plan, state, part)

    def add_env(plan, state, part):
        traces["env"] += 1
        return jaxtraj.add_env(plan, state, part)

    jp = jax.jit(add_policy, static_argnums=0, donate_argnums=1)
    je = jax.jit(add_env, static_argnums=0, donate_argnums=1)
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0))
    for e in range(E):
        for t in range(T):
            state = jp(PLAN, state, policy_part(t, e))
    # two structures: chunk 0 (initial_transition) and chunks 1, 2 (final_values)
    for e in range(E):
        for t in range(T):
            state = je(PLAN, state, env_part(t, e))
    assert traces["policy"] == 1
    assert traces["env"] == 2
    assert bool(jaxtraj.source_complete(state)[0])
    jaxtraj.raise_if_error(state)


def test_init_on_abstract_inputs():
    shapes = jax.eval_shape(lambda: jaxtraj.init(PLAN, policy_part(0), env_part(0)))
    assert shapes.policy.obs["image"].shape == (2, E, T, B, 2, 2, 3)
    assert shapes.policy.obs["image"].dtype == jnp.uint8
    assert shapes.env.final_values.shape == (2, E, T, B)


def test_vmap_over_sources_matches_facade():
    S = 2
    states = jax.vmap(
        lambda r: jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=jnp.stack([r, 0]))
    )(jnp.arange(S))
    stack = lambda ps: jax.tree.map(lambda *xs: np.stack(xs), *ps)
    add_p = jax.jit(jax.vmap(jaxtraj.add_policy, in_axes=(None, 0, 0)), static_argnums=0)
    add_e = jax.jit(jax.vmap(jaxtraj.add_env, in_axes=(None, 0, 0)), static_argnums=0)
    for e in range(E):
        for t in range(T):
            states = add_p(PLAN, states, stack([policy_part(t, e, r) for r in range(S)]))
            states = add_e(PLAN, states, stack([env_part(t, e, r) for r in range(S)]))
    assert np.all(jaxtraj.rollout.ready(states))
    trajs, states = jax.vmap(jaxtraj.rollout.flush, in_axes=(None, 0, None))(PLAN, states, 0)
    np.testing.assert_array_equal(states.step, [1, 1])
    np.testing.assert_array_equal(states.error_code, [0, 0])
    for r in range(S):
        assert_same(jax.tree.map(lambda x, r=r: x[r], trajs), reference(r))


def test_collect_transitions_resolves_next_obs():
    plan = jaxtraj.TrajectoryPlan(
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
    human = np.full((B, K * 3), 99.0, np.float32)
    tr = v.transition.replace(intervene_actions=human, intervene_flags=flags)
    step = jaxtraj.TrajectoryStep.from_parts(p, v.replace(transition=tr))
    expect = np.array(p.output.actions)
    expect[1, 0] = 99.0
    np.testing.assert_array_equal(step.actions, expect)
    assert step.intervene_flags.shape == expect.shape and int(step.intervene_flags.sum()) == 3
