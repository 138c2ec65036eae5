"""jaxtraj.state: ``init`` (also on abstract inputs), the error record, completeness by
coverage masks, and ``materialize``."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PLAN, A, B, E, K, T, all_parts, assert_same, env_part, policy_part, reference

import jaxtraj
from jaxtraj import CollectorError, ErrorCode, TrajectoryKey
from jaxtraj.state import record_error

abstract = lambda tree: jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree
)


def test_init_on_abstract_inputs():
    # Abstract examples (no data at all) and an abstract result: only shapes are read.
    p, v = abstract(policy_part(0)), abstract(env_part(0))
    shapes = jax.eval_shape(lambda: jaxtraj.init(PLAN, p, v))
    assert shapes.stacked  # two env ranks: one stacked state
    chex.assert_shape(shapes.policy.obs["image"], (2, E, T, B, 2, 2, 3))
    assert shapes.policy.obs["image"].dtype == jnp.uint8
    chex.assert_shape(shapes.policy.output.actions, (2, E, T, B, K, A))
    chex.assert_shape(shapes.env.final_values, (2, E, T, B))
    chex.assert_shape(shapes.initial.terminations, (2, E, B))
    chex.assert_shape([shapes.policy_rows, shapes.env_rows], (2, E, T, B))
    chex.assert_shape(shapes.sources, (2, 2))
    for counter in (shapes.step, shapes.errors, shapes.sources):
        assert counter.dtype == jnp.int32
    assert shapes.next_obs_given is None and shapes.env.next_obs is None
    # One source: no leading axis; equals the concrete init's structure.
    one = jax.eval_shape(lambda: jaxtraj.init(PLAN, p, v, sources=(1, 0), step_id=3))
    chex.assert_shape(one.policy.obs["image"], (E, T, B, 2, 2, 3))
    concrete = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(1, 0), step_id=3)
    assert jax.tree.structure(one) == jax.tree.structure(concrete)
    np.testing.assert_array_equal(concrete.sources, [1, 0])
    assert int(concrete.step) == 3 and not concrete.stacked


def test_init_reads_only_structure_not_rows_or_values():
    a = jaxtraj.init(PLAN, policy_part(0, rows=1), env_part(0, rows=1), sources=(0, 0))
    b = jaxtraj.init(PLAN, policy_part(2, epoch=1), env_part(1), sources=(0, 0))
    assert_same(a, b)
    assert not np.any(a.policy_rows) and not np.any(a.env_rows)


def test_init_rejects_examples_that_disagree_on_k():
    v = env_part(0)
    v = v.replace(transition=v.transition.replace(rewards=np.zeros((B, K + 1), np.float32)))
    with pytest.raises(CollectorError, match="rewards") as info:
        jaxtraj.init(PLAN, policy_part(0), v)
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH


def test_record_error_keeps_the_first_and_counts_all():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    k1, k2 = TrajectoryKey(1, 0, 0, 0, 2), TrajectoryKey(4, 1, 0, 0, 0)
    state = record_error(state, jnp.int32(0), k1)  # OK records nothing
    assert int(state.error_code) == 0 and int(state.error_count) == 0
    state = record_error(state, jnp.int32(ErrorCode.DUPLICATE), k1)
    state = record_error(state, jnp.int32(ErrorCode.STALE_STEP), k2)
    assert int(state.error_code) == ErrorCode.DUPLICATE
    np.testing.assert_array_equal(state.error_key, k1.as_tuple())
    assert int(state.error_count) == 2
    with pytest.raises(CollectorError) as info:
        jaxtraj.raise_if_error(state)
    assert info.value.code == ErrorCode.DUPLICATE and info.value.key == k1.as_tuple()


def test_record_error_on_a_stacked_state_records_per_source():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0))
    key = TrajectoryKey(0, 1, 1, 0, 2)
    state = jax.jit(record_error)(state, jnp.int32(ErrorCode.FUTURE_STEP), key, 1)
    np.testing.assert_array_equal(state.error_code, [0, ErrorCode.FUTURE_STEP])
    np.testing.assert_array_equal(state.error_count, [0, 1])
    np.testing.assert_array_equal(state.error_key[1], key.as_tuple())


def test_completeness_is_decided_by_coverage_of_every_row():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    add = {
        jaxtraj.PolicyPart: jax.jit(jaxtraj.add_policy, static_argnums=0),
        jaxtraj.EnvPart: jax.jit(jaxtraj.add_env, static_argnums=0),
    }
    state = add[jaxtraj.PolicyPart](PLAN, state, policy_part(1))
    for frag in env_part(1).split([1, 2, 1])[:2]:  # rows [0, 3) of 4
        state = add[jaxtraj.EnvPart](PLAN, state, frag)
    chex.assert_shape(jaxtraj.slot_complete(state), (E, T))
    assert not np.any(jaxtraj.slot_complete(state))
    state = add[jaxtraj.EnvPart](PLAN, state, env_part(1).split([3, 1])[1])
    want = np.zeros((E, T), bool)
    want[0, 1] = True
    np.testing.assert_array_equal(jaxtraj.slot_complete(state), want)
    assert not bool(jaxtraj.source_complete(state))
    for p in all_parts(0):
        if p.source.key.as_tuple()[1:] != (0, 0, 0, 1):
            state = add[type(p)](PLAN, state, p)
    assert bool(jaxtraj.source_complete(state))
    jaxtraj.raise_if_error(state)
    # The buffers hold every half in rollout order: materialize lays out the trajectory.
    assert_same(jaxtraj.materialize(PLAN, state), reference(0))
