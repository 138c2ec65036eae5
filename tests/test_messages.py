"""Errors that say what to fix, pinned: a structure mismatch names the field path with the
shapes and dtypes on both sides; ``INCOMPLETE_SCOPE`` says what the scope still waits for
(``missing()``, cut short); every ``CollectorError`` names its code and key."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import jaxtraj
from jaxtraj import CollectorError, ErrorCode

B, T = 2, 3
FLAGS = np.zeros((B,), bool)


def policy(t, obs=None, values=True, **kw):
    return jaxtraj.PolicyPart.at(
        chunk_id=t, obs={"state": np.zeros((B, 3), np.float32)} if obs is None else obs,
        actions=np.zeros((B, 1), np.float32),
        prev_values=np.zeros((B,), np.float32) if values else None, **kw)


def env(t, **kw):
    return jaxtraj.EnvPart.at(
        chunk_id=t, rewards=np.ones((B,), np.float32), terminations=FLAGS, truncations=FLAGS,
        initial_transition=jaxtraj.EnvTransition(terminations=FLAGS, truncations=FLAGS)
        if t == 0 else None,
        final_values=np.zeros((B,), np.float32) if t == T - 1 else None, **kw)


def collector(mode="rollout", **kw):
    plan = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B, mode=mode, **kw)
    return jaxtraj.TrajectoryCollector(plan, policy(0), env(0), auto_flush=False)


KEY1 = re.escape("key(step_id=0, epoch_id=0, env_rank=0, stage_id=0, chunk_id=1): STRUCTURE_MISMATCH")


def test_structure_mismatch_names_a_missing_field():
    c = collector()
    with pytest.raises(CollectorError, match=KEY1) as info:
        c.add(policy(1, obs={"image": np.zeros((B, 4, 4, 3), np.uint8)}))
    msg = str(info.value)
    assert "missing .obs['state'] (plan has (rows, 3) float32)" in msg, msg
    assert "not in the plan's example .obs['image'] ((rows, 4, 4, 3) uint8)" in msg, msg


def test_structure_mismatch_names_a_missing_output_field():
    """The issue's case: a policy half without prev_values where the example had them."""
    with pytest.raises(CollectorError, match=KEY1) as info:
        collector().add(policy(1, values=False))
    assert "PolicyOutput.prev_values" in str(info.value)


def test_structure_mismatch_names_shape_and_dtype_of_both_sides():
    with pytest.raises(CollectorError, match=KEY1) as info:
        collector().add(policy(1, obs={"state": np.zeros((B, 4), np.float16)}))
    assert "PolicyPart.obs['state']: got shape (2, 4) dtype float16, plan has (rows, 3) " \
        "dtype float32" in str(info.value)


def test_structure_mismatch_under_jit_names_the_field_at_trace_time():
    plan = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B)
    state = jaxtraj.init(plan, policy(0), env(0))
    bad = policy(1, obs={"state": np.zeros((B, 3), np.float32), "extra": np.zeros((B,), np.int32)})
    with pytest.raises(CollectorError, match="STRUCTURE_MISMATCH") as info:
        jax.jit(jaxtraj.add_policy, static_argnums=0)(plan, state, bad)
    assert "not in the plan's example .obs['extra'] ((rows,) int32)" in str(info.value)


def test_incomplete_scope_says_what_it_waits_for():
    c = collector()
    c.add(policy(0))
    c.add(env(0))
    c.add(policy(1))
    with pytest.raises(CollectorError) as info:
        c.flush(0, 0)
    assert info.value.code == ErrorCode.INCOMPLETE_SCOPE
    assert str(info.value) == (
        "training step 0 of source (env_rank=0, stage_id=0): INCOMPLETE_SCOPE: "
        "flush of an incomplete scope (scope (0, 0): waits for 3 halves: "
        "env half of key (0, 0, 0, 0, 1) (2 rows); env half of key (0, 0, 0, 0, 2) (2 rows); "
        "policy half of key (0, 0, 0, 0, 2) (2 rows))"
    )
    assert len(c.missing()) == 3


def test_incomplete_scope_is_cut_short_and_counts_fragment_rows():
    c = collector()
    half = jaxtraj.PolicyPart.at(chunk_id=0, batch_size=B, offset=1,
                                 obs={"state": np.zeros((1, 3), np.float32)},
                                 actions=np.zeros((1, 1), np.float32),
                                 prev_values=np.zeros((1,), np.float32))
    c.add(half)  # rows [1, 2) of chunk 0's policy half: one row still missing
    with pytest.raises(CollectorError) as info:
        c.flush(0, 0)
    msg = str(info.value)
    assert "waits for 6 halves: env half of key (0, 0, 0, 0, 0) (2 rows); policy half of " \
        "key (0, 0, 0, 0, 0) (1 row); env half of key (0, 0, 0, 0, 1) (2 rows); and 3 more " \
        "(collector.missing() lists them))" in msg, msg
    assert len(c.missing()) == 6


def test_incomplete_epoch_in_pipeline_mode_and_a_flushed_one():
    c = collector("pipeline", num_epochs=2, micro_batch_size=2)
    for t in range(T):
        c.add(policy(t))
        c.add(env(t))
    with pytest.raises(CollectorError) as info:
        c.flush(1)
    assert "scope 1: waits for 6 halves: env half of key (0, 1, 0, 0, 0) (2 rows)" in str(info.value)
    assert c.ready() == [0] and len(c.flush(0)) == 1
    with pytest.raises(CollectorError, match="scope 0: nothing is missing: it was flushed already"):
        c.flush(0)


def test_flush_with_no_scope_named_says_the_training_step_and_what_it_waits_for():
    c = collector()
    c.add(policy(0))
    with pytest.raises(CollectorError) as info:
        c.flush()
    msg = str(info.value)
    assert msg.startswith("training step 0 of source (env_rank=0, stage_id=0): INCOMPLETE_SCOPE"), msg
    assert "scope ()" not in msg and "-1" not in msg
    assert "flush() of the first scope: none is complete; it waits for 5 halves: env half of " \
        "key (0, 0, 0, 0, 0) (2 rows)" in msg, msg


def test_pure_flush_of_an_incomplete_step_names_the_scope_and_what_it_waits_for():
    """The pure path: chunk 0 never arrived; raise_if_error says which scope (no -1
    fields) and what it waits for, as the facade does."""
    plan = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B)
    state = jaxtraj.init(plan, policy(0), env(0))
    for t in (1, 2):
        state = jaxtraj.add_policy(plan, state, policy(t))
        state = jaxtraj.add_env(plan, state, env(t))
    _, state = jax.jit(jaxtraj.rollout.flush, static_argnums=0)(plan, state)
    with pytest.raises(CollectorError) as info:
        jaxtraj.raise_if_error(state)
    msg = str(info.value)
    assert "-1" not in msg, msg
    assert msg.startswith("training step 0 of source (env_rank=0, stage_id=0): INCOMPLETE_SCOPE")
    assert "waits for 2 halves: env half of key (0, 0, 0, 0, 0) (2 rows); policy half of key " \
        "(0, 0, 0, 0, 0) (2 rows)" in msg, msg


@pytest.mark.parametrize("field", ["rewards", "final_values"])
def test_a_nan_names_the_field_the_rows_and_the_action(field):
    c = collector()
    rewards = np.ones((B, 3), np.float32)
    final = np.zeros((B,), np.float32)
    if field == "rewards":
        rewards[1, 2] = np.nan
    else:
        final[0] = np.inf
    plan = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B)
    no = np.zeros((B, 3), bool)
    mk = lambda r, f: jaxtraj.EnvPart.at(  # noqa: E731
        chunk_id=0, rewards=r, terminations=no, truncations=no, final_values=f,
        initial_transition=jaxtraj.EnvTransition(terminations=no, truncations=no))
    p = jaxtraj.PolicyPart.at(chunk_id=0, obs={"state": np.zeros((B, 3), np.float32)},
                              actions=np.zeros((B, 3, 1), np.float32),
                              prev_values=np.zeros((B,), np.float32))
    c = jaxtraj.TrajectoryCollector(plan, p, mk(np.ones((B, 3), np.float32), final))
    with pytest.raises(CollectorError) as info:
        c.add(mk(rewards, final))
    assert info.value.code == ErrorCode.NON_FINITE
    msg = str(info.value)
    if field == "rewards":
        assert "EnvTransition.rewards rows [1] (row 1: action 2): nan" in msg, msg
    else:
        assert "EnvPart.final_values rows [0]: inf" in msg, msg
    # A stack through add_many names it too, with the part's place in the batch.
    with pytest.raises(CollectorError, match=r"EnvTransition.rewards rows \[1\]|EnvPart.final_values"):
        c.add_many([mk(rewards, final)])
