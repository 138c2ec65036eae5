"""jaxtraj.collector: the host facade. Sources flush independently, scopes are named the
mode's way, every mode has ``current_version``, and an empty fragment is a no-op."""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
import pytest
from helpers import PLAN, B, all_parts, assert_same, env_part, policy_part, reference, snapshot

import jaxtraj


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


def test_ready_and_flush_name_sources_in_rollout_mode():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), auto_flush=False)
    for p in all_parts(1):
        assert c.add(p) == []
    assert c.ready() == [(1, 0)]
    ((queue_key, traj),) = c.flush(1, 0)
    assert queue_key == PLAN.queue_key
    assert_same(traj, reference(1))
    assert c.ready() == [] and c.current_step(1) == 1 and c.current_step(0) == 0


@pytest.mark.parametrize("mode", ["rollout", "pipeline", "lerobot"])
def test_current_version_in_every_mode(mode):
    """Defect 3: rollout mode had no current_version."""
    plan = dataclasses.replace(PLAN, mode=mode)
    c = jaxtraj.TrajectoryCollector(plan, policy_part(0), env_part(0, per_action=True))
    assert c.current_version == 0
    c.current_version = 3
    assert c.state_dict()["current_version"] == 3


def test_zero_row_fragment_is_a_no_op():
    """Defect 10: a fragment with no rows is accepted, changes nothing, and the step
    still flushes the same trajectory."""
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    parts = all_parts(0)
    for p in parts[:4]:
        c.add(p)
    before = snapshot(c.state)
    assert c.add(policy_part(2, rows=0)) == []
    assert c.add(env_part(2, rows=0)) == []
    assert c.add_many([policy_part(2, rows=0), env_part(1, rows=0)]) == []
    assert_same(snapshot(c.state), before)
    out = [t for p in parts[4:] for _, t in c.add(p)]
    assert len(out) == 1
    assert_same(out[0], reference(0))


def test_layout_is_shapes_only():
    """Defect 6: runners read the buffers' layout without a host copy of the state, and
    the facade keeps no device copy of a source's buffers to read shapes."""
    c = jaxtraj.TrajectoryCollector(dataclasses.replace(PLAN, mode="pipeline"), policy_part(0),
                                    env_part(0))
    leaves = jax.tree.leaves(c.layout)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert c.layout.policy.obs["image"].shape[-3:] == policy_part(0).obs["image"].shape[1:]


def test_add_many_mixes_stacked_small_parts_and_large_parts(monkeypatch):
    """``add_many`` stacks many small parts and checks large ones one by one; both in
    one batch are still all or nothing, and the result is the reference."""
    from jaxtraj import collector

    policy_bytes = sum(x.nbytes for x in jax.tree.leaves(policy_part(0).replace(source=None)))
    monkeypatch.setattr(collector, "_SMALL_PART_BYTES", policy_bytes)  # policy halves: large
    monkeypatch.setattr(collector, "_STACK_AT_LEAST", 1)
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    parts = all_parts(0)[::-1]
    before = snapshot(c.state)
    bad = env_part(1).replace(final_values=np.full((B,), np.nan, np.float32))
    with pytest.raises(jaxtraj.CollectorError, match="part 4 of the batch") as info:
        c.add_many(parts[:4] + [bad] + parts[4:])
    assert info.value.code == jaxtraj.ErrorCode.NON_FINITE
    assert_same(snapshot(c.state), before)  # none of the batch went in
    (out,) = c.add_many(parts)
    assert_same(out[1], reference(0))


@pytest.mark.parametrize("storage", ["host", "device"])
def test_state_dict_is_a_snapshot(storage):
    """A state_dict taken mid-step (e.g. handed to an asynchronous checkpointer) is not
    changed by later collection: not by the rest of its step's writes into the same
    staging, nor by a later step reusing it, nor by donated device buffers."""
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), storage=storage)
    parts = all_parts(0)
    for p in parts[:5]:
        c.add(p)
    snap = c.state_dict()
    kept = jax.tree.map(np.array, snap)
    for p in parts[5:]:
        c.add(p)
    for k in range(1, 4):
        for p in all_parts(0, step=k):
            c.add(p)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, snap), kept)


def test_stacked_part_with_unequal_leading_axes_is_refused_before_any_write():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    two = jaxtraj.stack_parts([policy_part(0), policy_part(1)])[0]
    bad = two.replace(output=two.output.replace(actions=two.output.actions[:1]))
    before = snapshot(c.state)
    with pytest.raises(jaxtraj.CollectorError, match="one leading axis N") as info:
        c.add_many(bad)
    assert info.value.code == jaxtraj.ErrorCode.STRUCTURE_MISMATCH
    assert_same(snapshot(c.state), before)
    assert not c.state.policy_rows.any()


def test_collector_error_pickles():
    import pickle

    err = jaxtraj.CollectorError((0, 0, 1, 0, 2), jaxtraj.ErrorCode.DUPLICATE, "part 3 of the batch")
    back = pickle.loads(pickle.dumps(err))
    assert (back.key, back.code, back.detail, str(back)) == (err.key, err.code, err.detail, str(err))
