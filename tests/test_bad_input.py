"""Every row of DESIGN.md's bad-input table: a clear error naming the key and the
reason, nothing changed, and the step still flushes to the same result."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (
    PLAN,
    B,
    E,
    T,
    all_parts,
    assert_same,
    env_part,
    policy_part,
    reference,
    snapshot,
)

import jaxtraj
from jaxtraj import CollectorError, ErrorCode

STEP = 1  # the collector is on step 1, so stale and future steps both exist


def _frag(part, sizes, i):
    return part.split(sizes)[i]


def _with_offset(part, offset, batch_size=B):
    return part.replace(source=part.source.replace(offset=offset, batch_size=batch_size))


def _nan_rewards():
    v = env_part(2, 1, step=STEP)
    r = np.array(v.transition.rewards)
    r[2, 0] = np.nan
    return v.replace(transition=v.transition.replace(rewards=r))


def _truncated_without_value():
    v = env_part(0, 1, step=STEP)  # chunk 0 carries no final_values in the helpers
    trunc = np.zeros((B,), bool)
    trunc[1] = True
    return v.replace(transition=v.transition.replace(truncations=trunc))


def _inf_value():
    p = policy_part(1, 1, step=STEP)
    vals = np.array(p.output.prev_values)
    vals[0] = np.inf
    return p.replace(output=p.output.replace(prev_values=vals))


def _prefix_and_rest():
    """Epoch 0 complete, epoch 1 chunk 1's env half only rows [0, 2): the collector
    holds partial slots and a fragment when the bad part arrives."""
    parts = all_parts(step=STEP)
    env11 = env_part(1, 1, step=STEP)
    prefix = [p for p in parts if int(p.source.key.epoch_id) == 0]
    prefix.append(_frag(env11, [2, 2], 0))
    rest = [p for p in parts if int(p.source.key.epoch_id) == 1 and p is not None]
    rest = [
        p for p in rest if not (isinstance(p, jaxtraj.EnvPart) and int(p.source.key.chunk_id) == 1)
    ]
    rest.append(_frag(env11, [2, 2], 1))
    return prefix, rest


# (name, bad part factory, expected code, detectable under jit)
CASES = [
    ("same half twice", lambda: policy_part(0, 0, step=STEP), ErrorCode.DUPLICATE),
    (
        "same fragment rows twice",
        lambda: _frag(env_part(1, 1, step=STEP), [2, 2], 0),
        ErrorCode.DUPLICATE,
    ),
    (
        "overlapping fragment rows",
        lambda: _frag(env_part(1, 1, step=STEP), [1, 2, 1], 1),
        ErrorCode.DUPLICATE,
    ),
    (
        "rows beyond batch_size",
        lambda: _with_offset(_frag(policy_part(0, 1, step=STEP), [2, 2], 0), 3),
        ErrorCode.ROWS_OUT_OF_RANGE,
    ),
    (
        "negative offset",
        lambda: _with_offset(_frag(policy_part(0, 1, step=STEP), [2, 2], 0), -1),
        ErrorCode.ROWS_OUT_OF_RANGE,
    ),
    (
        "batch_size differs",
        lambda: _with_offset(policy_part(0, 1, step=STEP), 0, B * 2),
        ErrorCode.BATCH_SIZE_MISMATCH,
    ),
    ("chunk_id >= T", lambda: policy_part(T, 1, step=STEP), ErrorCode.CHUNK_OUT_OF_RANGE),
    ("epoch_id >= E", lambda: policy_part(0, E, step=STEP), ErrorCode.EPOCH_OUT_OF_RANGE),
    (
        "unknown env_rank",
        lambda: policy_part(0, 1, env_rank=7, step=STEP),
        ErrorCode.UNKNOWN_SOURCE,
    ),
    ("unknown stage_id", lambda: env_part(2, 1, stage=1, step=STEP), ErrorCode.UNKNOWN_SOURCE),
    ("stale step_id", lambda: policy_part(0, 1, step=STEP - 1), ErrorCode.STALE_STEP),
    ("future step_id", lambda: env_part(0, 1, step=STEP + 1), ErrorCode.FUTURE_STEP),
    (
        "chunk 0 without initial_transition",
        lambda: env_part(0, 1, step=STEP).replace(initial_transition=None),
        ErrorCode.MISSING_INITIAL_TRANSITION,
    ),
    (
        "initial_transition off chunk 0",
        lambda: env_part(2, 1, step=STEP).replace(
            initial_transition=env_part(0).initial_transition
        ),
        ErrorCode.UNEXPECTED_INITIAL_TRANSITION,
    ),
    (
        "last chunk without bootstrap value",
        lambda: env_part(T - 1, 1, step=STEP).replace(final_values=None),
        ErrorCode.MISSING_FINAL_VALUES,
    ),
    (
        "truncation without its bootstrap value",
        _truncated_without_value,
        ErrorCode.MISSING_FINAL_VALUES,
    ),
    ("non-finite reward", _nan_rewards, ErrorCode.NON_FINITE),
    ("non-finite value", _inf_value, ErrorCode.NON_FINITE),
]

STRUCTURE_CASES = [
    (
        "extra observation key",
        lambda: policy_part(0, 1, step=STEP).replace(
            obs={**policy_part(0).obs, "depth": np.zeros((B, 1), np.float32)}
        ),
    ),
    (
        "wrong trailing shape",
        lambda: policy_part(0, 1, step=STEP).replace(
            obs={**policy_part(0).obs, "state": np.zeros((B, 6), np.float32)}
        ),
    ),
    (
        "wrong dtype",
        lambda: policy_part(0, 1, step=STEP).replace(
            obs={**policy_part(0).obs, "image": np.zeros((B, 2, 2, 3), np.float32)}
        ),
    ),
    (
        "missing reward",
        lambda: env_part(2, 1, step=STEP).replace(
            transition=env_part(2).transition.replace(rewards=None)
        ),
    ),
    ("not a part", lambda: {"obs": 1}),
]


def _collector():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), step_id=STEP)
    prefix, rest = _prefix_and_rest()
    for p in prefix:
        assert c.add(p) == []
    return c, rest


@pytest.mark.parametrize("name,make,code", CASES, ids=[c[0] for c in CASES])
def test_facade_rejects_and_keeps_everything(name, make, code):
    c, rest = _collector()
    before = snapshot(c.state)
    bad = make()
    with pytest.raises(CollectorError) as info:
        c.add(bad)
    assert info.value.code == code
    assert info.value.key == bad.source.key.as_tuple()
    assert "key(step_id=" in str(info.value)
    assert_same(snapshot(c.state), before)
    out = []
    for p in rest:
        out += c.add(p)
    assert len(out) == 1
    assert_same(out[0][1], reference(step=STEP, fresh=True))


@pytest.mark.parametrize("name,make", STRUCTURE_CASES, ids=[c[0] for c in STRUCTURE_CASES])
def test_structure_rejected_before_tracing(name, make):
    c, rest = _collector()
    before = snapshot(c.state)
    with pytest.raises(CollectorError) as info:
        c.add(make())
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH
    assert_same(snapshot(c.state), before)
    # The pure function raises the same error at trace time, before anything runs.
    if name != "not a part":
        state = jaxtraj.init(PLAN, policy_part(0), env_part(0))
        add = jaxtraj.add_policy if isinstance(make(), jaxtraj.PolicyPart) else jaxtraj.add_env
        with pytest.raises(CollectorError, match="differs from the plan"):
            jax.jit(add, static_argnums=0)(PLAN, state, make())
    out = []
    for p in rest:
        out += c.add(p)
    assert_same(out[0][1], reference(step=STEP, fresh=True))


def test_flush_of_incomplete_scope():
    c, rest = _collector()
    c.auto_flush = False
    before = snapshot(c.state)
    with pytest.raises(CollectorError, match="incomplete") as info:
        c.flush(0, 0)
    assert info.value.code == ErrorCode.INCOMPLETE_SCOPE
    assert_same(snapshot(c.state), before)
    for p in rest:
        assert c.add(p) == []
    assert c.ready() == [(0, 0)]
    assert_same(c.flush(0, 0)[0][1], reference(step=STEP, fresh=True))


_add_policy = jax.jit(jaxtraj.add_policy, static_argnums=0, donate_argnums=1)
_add_env = jax.jit(jaxtraj.add_env, static_argnums=0, donate_argnums=1)
_flush = jax.jit(jaxtraj.rollout.flush, static_argnums=0, donate_argnums=1)


def _pure_add(state, part):
    add = _add_policy if isinstance(part, jaxtraj.PolicyPart) else _add_env
    return add(PLAN, state, part)


@pytest.mark.parametrize("name,make,code", CASES, ids=[c[0] for c in CASES])
def test_jitted_functions_record_error_and_keep_data(name, make, code):
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), step_id=STEP)
    prefix, rest = _prefix_and_rest()
    for p in prefix:
        state = _pure_add(state, p)
    jaxtraj.raise_if_error(state)
    before = snapshot(state)
    bad = make()
    state = _pure_add(state, bad)
    # A stacked state (two sources) records per source; the part's own, or source 0's
    # when its source is unknown.
    codes = np.asarray(state.error_code)
    assert codes.max() == code and int(np.sum(state.error_count)) == 1
    np.testing.assert_array_equal(
        np.asarray(state.error_key)[codes.argmax()], bad.source.key.as_tuple()
    )
    # Only the error record changed.
    strip = lambda s: s.replace(errors=0)
    assert_same(strip(snapshot(state)), strip(before))
    with pytest.raises(CollectorError) as info:
        jaxtraj.raise_if_error(state)
    assert info.value.code == code and info.value.key == bad.source.key.as_tuple()
    for p in rest:
        state = _pure_add(state, p)
    traj, state = _flush(PLAN, state, 0)
    assert int(np.sum(state.error_count)) == 1  # nothing else was rejected
    assert_same(traj, reference(step=STEP, fresh=True))


def test_jitted_flush_of_incomplete_scope_records_error():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0))
    state = _pure_add(state, policy_part(0))
    before = snapshot(state)
    _, state = _flush(PLAN, state, 0)
    assert np.asarray(state.error_code).tolist() == [ErrorCode.INCOMPLETE_SCOPE, 0]
    strip = lambda s: s.replace(errors=0)
    assert_same(strip(snapshot(state)), strip(before))


def test_add_many_is_all_or_nothing():
    c, rest = _collector()
    before = snapshot(c.state)
    with pytest.raises(CollectorError) as info:
        c.add_many(rest[:3] + [policy_part(T, 1, step=STEP)] + rest[3:])
    assert info.value.code == ErrorCode.CHUNK_OUT_OF_RANGE
    assert_same(snapshot(c.state), before)
    out = c.add_many(rest)
    assert_same(out[0][1], reference(step=STEP, fresh=True))


def _overlapping_fragments(sizes):
    """Two fragments of epoch 1, chunk 2's env half whose rows overlap: rows [0, 2) and
    the second fragment of a ``sizes`` split."""
    v = env_part(2, 1, step=STEP)
    return [_frag(v, [2, 2], 0), _frag(v, sizes, 1)]


DUPLICATES_IN_ONE_BATCH = [
    ("the same part twice", lambda rest: [rest[0], rest[1], rest[0]]),
    ("overlapping fragments, same shape", lambda rest: _overlapping_fragments([1, 2, 1])),
    ("overlapping fragments, other shapes", lambda rest: _overlapping_fragments([1, 3])),
]


@pytest.mark.parametrize("stacked", [False, True], ids=["one by one", "stacked"])
@pytest.mark.parametrize(
    "name,batch", DUPLICATES_IN_ONE_BATCH, ids=[c[0] for c in DUPLICATES_IN_ONE_BATCH]
)
def test_add_many_rejects_rows_repeated_within_the_batch(name, batch, stacked, monkeypatch):
    """Defect 15b: rows repeated within one add_many are duplicates too, whether the
    batch's parts are checked one by one or stacked (many small parts)."""
    from jaxtraj import collector

    monkeypatch.setattr(collector, "_STACK_AT_LEAST", 1 if stacked else 10**9)
    c, rest = _collector()
    before = snapshot(c.state)
    with pytest.raises(CollectorError) as info:
        c.add_many(batch(rest))
    assert info.value.code == ErrorCode.DUPLICATE
    assert_same(snapshot(c.state), before)
    out = c.add_many(rest)
    assert len(out) == 1
    assert_same(out[0][1], reference(step=STEP, fresh=True))


@pytest.mark.parametrize("stacked", [False, True], ids=["one by one", "stacked"])
def test_add_many_refuses_a_narrower_dtype_among_right_ones(stacked, monkeypatch):
    """A part whose rewards are float16 among float32 parts is refused in a batch as it is
    alone (no dtype is cast): stacking the batch must not widen it to the others'."""
    from jaxtraj import collector

    monkeypatch.setattr(collector, "_STACK_AT_LEAST", 1 if stacked else 10**9)
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), step_id=STEP)
    before = snapshot(c.state)
    right, v = env_part(1, 0, step=STEP), env_part(1, 1, step=STEP)
    narrow = v.replace(transition=v.transition.replace(
        rewards=np.asarray(v.transition.rewards, np.float16)))
    assert jax.tree.structure(right) == jax.tree.structure(narrow)
    with pytest.raises(CollectorError) as alone:
        c.add(narrow)
    assert alone.value.code == ErrorCode.STRUCTURE_MISMATCH
    with pytest.raises(CollectorError) as info:
        c.add_many([right, narrow])
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH
    assert "rewards" in str(info.value) and "float16" in str(info.value)
    assert_same(snapshot(c.state), before)


def _stacked_env_parts():
    """Two whole env halves of one structure (chunk 1 of both epochs), stacked."""
    (group,) = jaxtraj.stack_parts([env_part(1, 0, step=STEP), env_part(1, 1, step=STEP)])
    return group


def _with_keys(group, **fields):
    return group.replace(source=group.source.replace(key=group.source.key.replace(**fields)))


def _fresh():
    return jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), step_id=STEP)


@pytest.mark.parametrize("values", [[STEP, STEP], [0.7, 0.2], [STEP, 0.5]], ids=str)
def test_a_stack_with_keys_of_object_dtype_is_refused_whatever_they_hold(values):
    """Key fields of a stack must be integer arrays: an object array is refused even when
    its first value is an integer (a stack of integer keys checked before must not make
    later ones pass), and nothing is truncated or written."""
    c = _fresh()
    c.add_many(_with_keys(_stacked_env_parts(), chunk_id=np.array([1, 1], np.int64)))
    before = snapshot(c.state)
    bad = _stacked_env_parts()
    bad = _with_keys(bad, step_id=np.array(values, object), chunk_id=np.array([2, 2]))
    with pytest.raises(CollectorError, match="source.step_id must be an integer") as info:
        c.add_many(bad)
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH
    assert_same(snapshot(c.state), before)


def test_a_stack_with_uint64_keys_collects_as_int64_keys_do():
    """uint64 keys (accepted by ``add``) in a stack: the same step as int64 keys (they
    once left rows marked and counts unchanged, and the step could never complete)."""
    parts = all_parts(step=STEP)
    as_u64 = [p.replace(source=p.source.replace(key=jax.tree.map(np.uint64, p.source.key)))
              for p in parts]
    out = []
    c = _fresh()
    for group in jaxtraj.stack_parts(as_u64):
        out += c.add_many(group)
    assert len(out) == 1
    assert_same(out[0][1], reference(step=STEP, fresh=True))


def test_a_stack_with_an_offset_near_the_int64_limit_is_out_of_range():
    c = _fresh()
    before = snapshot(c.state)
    bad = _stacked_env_parts()
    bad = bad.replace(source=bad.source.replace(offset=np.int64(2**63 - 2)))
    with pytest.raises(CollectorError) as info:
        c.add_many(bad)
    assert info.value.code == ErrorCode.ROWS_OUT_OF_RANGE
    huge = bad.replace(source=bad.source.replace(offset=2**70))  # a Python int
    with pytest.raises(CollectorError) as info:
        c.add_many(huge)
    assert info.value.code == ErrorCode.ROWS_OUT_OF_RANGE
    assert_same(snapshot(c.state), before)


def test_a_stacked_structure_error_names_the_part_and_its_key(monkeypatch):
    from jaxtraj import collector

    monkeypatch.setattr(collector, "_STACK_AT_LEAST", 1)
    c = _fresh()
    v = env_part(1, 1, step=STEP)
    narrow = v.replace(transition=v.transition.replace(
        rewards=np.asarray(v.transition.rewards, np.float16)))
    with pytest.raises(CollectorError, match="part 1 of the batch") as info:
        c.add_many([policy_part(1, 1, step=STEP), narrow, policy_part(2, 1, step=STEP)])
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH
    assert tuple(info.value.key) == (STEP, 1, 0, 0, 1)


def test_a_payload_leaf_that_is_not_numbers_is_a_structure_mismatch():
    c = _fresh()
    p = policy_part(1, 1, step=STEP)
    bad = p.replace(output=p.output.replace(prev_values="not values"))
    with pytest.raises(CollectorError, match="prev_values") as info:
        c.add(bad)
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH


def test_an_empty_stack_inserts_nothing():
    c = _fresh()
    before = snapshot(c.state)
    empty = jax.tree.map(lambda x: np.asarray(x)[:0], _stacked_env_parts())
    assert c.add_many(empty) == []
    assert_same(snapshot(c.state), before)
    assert c.missing() == _fresh().missing()
