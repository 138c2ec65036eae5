"""jaxtraj.checks: every rule written once over ``xp``. The host facade (plain Python
scalars, numpy stacks) and the jitted pure functions (``jax.numpy``) reject the same
parts with the same codes; structure and dtypes are checked before tracing."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PLAN, B, E, T, all_parts, assert_same, env_part, policy_part, snapshot
from test_bad_input import CASES, STEP, STRUCTURE_CASES, _prefix_and_rest

import jaxtraj
from jaxtraj import CollectorError, EnvTransition, ErrorCode, TrajectoryKey, TrajectorySource
from jaxtraj.checks import (
    HostChecks,
    Layout,
    env_checks,
    first_error,
    key_checks,
    keys_pass,
    py,
)


def test_key_rules_agree_on_host_numpy_and_jit():
    rows, step = 2, 1
    grid = list(
        itertools.product(
            (-1, 0, E),  # epoch_id
            (-1, 1, T),  # chunk_id
            (0, 1, 2),  # step_id: stale, current, future
            (B, 2 * B),  # batch_size
            (-1, 0, B - 1),  # offset
            (True, False),  # found
        )
    )

    def source(e, t, st, bs, off):
        return TrajectorySource(TrajectoryKey(st, e, 0, 0, t), bs, off)

    host = [
        first_error(py, key_checks(py, PLAN, source(e, t, st, bs, off), rows, found, step))
        for e, t, st, bs, off, found in grid
    ]
    cols = [np.array(c) for c in zip(*grid)]
    stacked = first_error(np, key_checks(np, PLAN, source(*cols[:5]), rows, cols[5], step))

    @jax.jit
    def traced(e, t, st, bs, off, found):
        return first_error(jnp, key_checks(jnp, PLAN, source(e, t, st, bs, off), rows, found, step))

    jitted = jax.vmap(traced)(*[jnp.asarray(c) for c in cols])
    np.testing.assert_array_equal(stacked, host)
    np.testing.assert_array_equal(jitted, host)
    # The host's one-expression fast test passes exactly when every key rule does.
    key = lambda e, t, st: (st, e, 0, 0, t)
    passes = [bool(keys_pass(PLAN, key(e, t, st), bs, off, rows, found, step))
              for e, t, st, bs, off, found in grid]
    assert passes == [code == ErrorCode.OK for code in host]
    passes_np = keys_pass(PLAN, key(*cols[:3]), cols[3], cols[4], rows, cols[5], step)
    np.testing.assert_array_equal(passes_np, passes)
    assert set(host) == {
        ErrorCode.OK,
        ErrorCode.UNKNOWN_SOURCE,
        ErrorCode.EPOCH_OUT_OF_RANGE,
        ErrorCode.CHUNK_OUT_OF_RANGE,
        ErrorCode.STALE_STEP,
        ErrorCode.FUTURE_STEP,
        ErrorCode.BATCH_SIZE_MISMATCH,
        ErrorCode.ROWS_OUT_OF_RANGE,
    }


def test_env_rules_agree_on_host_numpy_and_jit():
    plan = dataclasses.replace(PLAN, collect_transitions=True)
    grid = list(itertools.product(range(T), *[(False, True)] * 5))
    layout = lambda init, final, nxt: Layout(B, init, final, nxt, True)

    def rules(xp, t, init, final, nxt, needs, cut):
        return first_error(
            xp, env_checks(xp, plan, t, layout(init, final, nxt), needs_final=needs, cut=cut)
        )

    host = [rules(py, *g) for g in grid]
    for needs in (False, True):  # static arguments: the layout and needs_final
        for init, final, nxt in itertools.product((False, True), repeat=3):
            sub = [
                (t, cut)
                for t, i, f, n, nd, cut in grid
                if (i, f, n, nd) == (init, final, nxt, needs)
            ]
            t, cut = (np.array(c) for c in zip(*sub))
            want = [rules(py, ti, init, final, nxt, needs, ci) for ti, ci in sub]
            np.testing.assert_array_equal(rules(np, t, init, final, nxt, needs, cut), want)
            jitted = jax.jit(lambda t, c: rules(jnp, t, init, final, nxt, needs, c))(t, cut)
            np.testing.assert_array_equal(jitted, want)
    assert {int(c) for c in host} == {
        ErrorCode.OK,
        ErrorCode.MISSING_INITIAL_TRANSITION,
        ErrorCode.UNEXPECTED_INITIAL_TRANSITION,
        ErrorCode.MISSING_FINAL_VALUES,
        ErrorCode.MISSING_NEXT_OBS,
    }


_add = {
    jaxtraj.PolicyPart: jax.jit(jaxtraj.add_policy, static_argnums=0),
    jaxtraj.EnvPart: jax.jit(jaxtraj.add_env, static_argnums=0),
}


def _host_code(checks, state, part, stacked):
    rows = np.asarray(state.policy_rows if isinstance(part, jaxtraj.PolicyPart) else state.env_rows)
    try:
        if stacked:  # a stack of one: the numpy path the facade's add_many takes
            one = jax.tree.map(lambda x: np.asarray(x)[None], part)
            checks.stack(one, rows.copy(), np.asarray(state.step))  # (sources, layout)
        else:  # the plain-Python path of the facade's add
            checks.one(part, rows, np.asarray(state.step))
    except CollectorError as err:
        return err.code
    return ErrorCode.OK


def test_host_and_jit_reject_the_same_part_with_the_same_code():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), step_id=STEP)  # two sources
    for p in _prefix_and_rest()[0]:
        state = _add[type(p)](PLAN, state, p)
    jaxtraj.raise_if_error(state)
    layout = jax.eval_shape(lambda: jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0)))
    checks = HostChecks(PLAN, layout, np.asarray(PLAN.default_sources()))
    for name, make, code in CASES:
        bad = make()
        jit_code = int(np.max(_add[type(bad)](PLAN, state, bad).error_code))
        host = [_host_code(checks, state, bad, stacked) for stacked in (False, True)]
        assert host == [code, code] and jit_code == code, name


@pytest.mark.parametrize(
    "name,make", STRUCTURE_CASES[:-1], ids=[c[0] for c in STRUCTURE_CASES[:-1]]
)
def test_host_and_trace_time_structure_checks_agree(name, make):
    layout = jax.eval_shape(lambda: jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0)))
    with pytest.raises(CollectorError) as host:
        HostChecks(PLAN, layout, np.asarray([[0, 0]])).structure(make())
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    bad = make()
    with pytest.raises(CollectorError) as traced:
        jax.jit(
            jaxtraj.add_policy if isinstance(bad, jaxtraj.PolicyPart) else jaxtraj.add_env,
            static_argnums=0,
        )(PLAN, state, bad)
    assert host.value.code == traced.value.code == ErrorCode.STRUCTURE_MISMATCH
    assert str(host.value).split(": ", 1)[-1] == str(traced.value).split(": ", 1)[-1]


# -- defect 10: dtypes must equal the buffers', key fields must be integers ---------------


def _float64_obs():
    p = policy_part(0, 1, step=STEP)
    return p.replace(obs={**p.obs, "state": p.obs["state"].astype(np.float64)})


def _int64_versions():
    p = policy_part(0, 1, step=STEP)
    return p.replace(output=p.output.replace(versions=p.output.versions.astype(np.int64)))


def _float64_rewards():
    v = env_part(2, 1, step=STEP)
    return v.replace(
        transition=v.transition.replace(rewards=v.transition.rewards.astype(np.float64))
    )


def _fractional_chunk():
    p = policy_part(1, 1, step=STEP)
    return p.replace(source=p.source.replace(key=p.source.key.replace(chunk_id=1.5)))


DTYPE_CASES = [
    ("float64 observation", _float64_obs, "state"),
    ("int64 versions", _int64_versions, "versions"),
    ("float64 rewards", _float64_rewards, "rewards"),
    # add names the value only ("key field 1.5 is not an int"), add_many the field.
    ("chunk_id 1.5", _fractional_chunk, r"chunk_id|1\.5"),
]


@pytest.mark.parametrize("name,make,field", DTYPE_CASES, ids=[c[0] for c in DTYPE_CASES])
def test_facade_rejects_other_dtypes_and_non_integer_keys(name, make, field):
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), step_id=STEP)
    prefix, rest = _prefix_and_rest()
    c.add_many(prefix)
    before = snapshot(c.state)
    for add in (c.add, lambda p: c.add_many([p])):
        with pytest.raises(CollectorError, match=field) as info:
            add(make())
        assert info.value.code == ErrorCode.STRUCTURE_MISMATCH
        assert_same(snapshot(c.state), before)


def test_non_integer_key_is_rejected_at_trace_time():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    bad = policy_part(1)
    bad = bad.replace(source=bad.source.replace(key=bad.source.key.replace(chunk_id=1.5)))
    with pytest.raises(CollectorError, match="chunk_id") as info:
        jax.jit(jaxtraj.add_policy, static_argnums=0)(PLAN, state, bad)
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH


# -- defect 1: truncation_bootstrap="done" and a transition without done flags -----------


def _without_flags(v):
    initial = EnvTransition() if v.initial_transition is not None else None
    return v.replace(
        transition=EnvTransition(rewards=v.transition.rewards), initial_transition=initial
    )


def test_done_bootstrap_without_any_done_flags_is_accepted():
    plan = dataclasses.replace(PLAN, truncation_bootstrap="done")
    parts = [p if isinstance(p, jaxtraj.PolicyPart) else _without_flags(p) for p in all_parts(0)]
    c = jaxtraj.TrajectoryCollector(plan, policy_part(0), _without_flags(env_part(0)))
    out = [t for p in parts for _, t in c.add(p)]
    assert len(out) == 1
    traj = out[0]
    assert traj.dones is None
    for e in range(E):
        for t in range(T):
            v = env_part(t, e)
            bare = v.transition.replace(terminations=None, truncations=None)
            want = bare.chunk_rewards(bare.compute_rewards(), v.final_values, gamma=plan.gamma,
                                      bootstrap="done")  # no flags: nothing bootstraps
            np.testing.assert_allclose(want, v.transition.rewards.sum(-1))
            np.testing.assert_array_equal(traj.rewards[e, t], v.transition.rewards)
    # The pure functions under jit: accepted, and the same trajectory.
    state = jaxtraj.init(plan, policy_part(0), _without_flags(env_part(0)), sources=(0, 0))
    for p in parts:
        state = _add[type(p)](plan, state, p)
    flushed, state = jax.jit(jaxtraj.rollout.flush, static_argnums=0)(plan, state)
    jaxtraj.raise_if_error(state)
    assert_same(flushed, traj)
