"""jaxtraj.joiner: the pure inserts. They do not retrace, a stack of parts equals the
same parts one at a time, and they compose with ``jax.vmap`` over sources (``pmap``
over sources, one per device, runs in its own process: scripts/multidevice_check.py)."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from helpers import (
    PLAN,
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


def _jitted(n_policy, n_env):
    """Jitted donated inserts that fail if traced more than ``n_*`` times."""
    return {
        jaxtraj.PolicyPart: jax.jit(
            chex.assert_max_traces(lambda plan, st, p: jaxtraj.add_policy(plan, st, p), n=n_policy),
            static_argnums=0,
            donate_argnums=1,
        ),
        jaxtraj.EnvPart: jax.jit(
            chex.assert_max_traces(lambda plan, st, p: jaxtraj.add_env(plan, st, p), n=n_env),
            static_argnums=0,
            donate_argnums=1,
        ),
    }


def test_no_retrace_on_repeated_inserts():
    # One policy structure; two env structures: chunk 0 (initial_transition) and
    # chunks 1, 2 (final_values). A second step reuses every compiled insert.
    add = _jitted(n_policy=1, n_env=2)
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    for step in (0, 1):
        for p in all_parts(0, step=step):
            state = add[type(p)](PLAN, state, p)
        assert bool(jaxtraj.source_complete(state))
        traj, state = jaxtraj.rollout.flush(PLAN, state)
        assert_same(traj, reference(0, step=step))
    jaxtraj.raise_if_error(state)


def test_stacked_inserts_equal_one_at_a_time():
    parts = all_parts(0) + all_parts(1)
    add = _jitted(n_policy=1, n_env=2)
    one = jaxtraj.init(PLAN, policy_part(0), env_part(0))  # both sources, stacked
    for p in parts:
        one = add[type(p)](PLAN, one, p)
    many = jaxtraj.init(PLAN, policy_part(0), env_part(0))
    add_many = {
        jaxtraj.PolicyPart: jax.jit(jaxtraj.add_policies, static_argnums=0),
        jaxtraj.EnvPart: jax.jit(jaxtraj.add_envs, static_argnums=0),
    }
    groups = jaxtraj.stack_parts(parts)
    assert len(groups) == 3  # policy; env chunk 0; env chunks 1, 2
    for group in groups:
        many = add_many[type(group)](PLAN, many, group)
    assert_same(snapshot(many), snapshot(one))
    jaxtraj.raise_if_error(many)


def test_facade_add_many_equals_one_at_a_time():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    parts = all_parts(0) + all_parts(1)
    order = np.random.default_rng(0).permutation(len(parts))
    out = c.add_many([parts[i] for i in order[:10]])
    out += c.add_many([parts[i] for i in order[10:]])
    assert sorted(int(t.env_rank) for _, t in out) == [0, 1]
    for _, t in out:
        assert_same(t, reference(int(t.env_rank)))


def test_vmap_over_sources_matches_facade():
    S = 2
    states = jax.vmap(
        lambda r: jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=jnp.stack([r, 0]))
    )(jnp.arange(S, dtype=jnp.int32))
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


def test_zero_row_fragment_is_a_no_op():
    """Defect 10: a fragment with no rows is accepted and changes nothing."""
    add = _jitted(n_policy=2, n_env=3)  # the empty fragments are shapes of their own
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    parts = all_parts(0)
    for p in parts[:4]:
        state = add[type(p)](PLAN, state, p)
    before = snapshot(state)
    for empty in (policy_part(2, rows=0), env_part(2, rows=0)):
        assert jax.tree.leaves(empty.replace(source=None))[0].shape[0] == 0
        state = add[type(empty)](PLAN, state, empty)
        assert_same(snapshot(state), before)  # error record included: nothing rejected
    for p in parts[4:]:
        state = add[type(p)](PLAN, state, p)
    traj, state = jaxtraj.rollout.flush(PLAN, state)
    assert_same(traj, reference(0))
    jaxtraj.raise_if_error(state)


def _top_level_instructions(hlo: str) -> list[str]:
    """The instructions of a compiled HLO module outside fused computations (what XLA
    materialises in memory), one line each."""
    blocks, name, body = {}, None, []
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            body = blocks.setdefault(name, [])
        elif line.startswith("}"):
            name = None
        elif name is not None:
            body.append(line.strip())
    fused = {
        c.lstrip("%")
        for b in blocks.values()
        for ln in b
        if " fusion(" in ln
        for c in ln.split("calls=")[1:2]
        for c in [c.split(",")[0].split()[0]]
    }
    return [ln for n, b in blocks.items() if n not in fused for ln in b]


def test_an_insert_under_scan_copies_no_operand_outside_its_write():
    """One write per byte under jit: a scan of add_policy + add_env over the chunks
    compiles to in-place writes of the parts' rows, with no conditional around them and no
    materialised copy of a part (a lax.cond around the write made XLA copy the scanned
    slice, the whole image, before writing it)."""
    B, H = 4, 16
    plan = dataclasses.replace(PLAN, num_chunks=3, num_epochs=1, batch_size=B)
    rng = np.random.default_rng(0)

    def halves(t):
        p = policy_part(t, rows=B).replace(
            obs={
                "image": rng.integers(0, 255, (B, H, H, 3), dtype=np.uint8),
                "state": np.zeros((B, 5), np.float32),
            }
        )
        e = env_part(t, rows=B)
        return p, e.replace(
            initial_transition=env_part(0, rows=B).initial_transition,
            final_values=np.zeros((B,), np.float32),
        )

    parts = [halves(t) for t in range(plan.num_chunks)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
    state = jaxtraj.init(plan, *parts[0])

    def scan(st, stacked):
        def body(st, x):
            st = jaxtraj.add_policy(plan, st, x[0])
            return jaxtraj.add_env_uniform(plan, st, x[1]), None

        return jax.lax.scan(body, st, stacked)[0]

    fn = jax.jit(scan, donate_argnums=0)
    hlo = fn.lower(state, stacked).compile().as_text()
    top = _top_level_instructions(hlo)
    part_image = f"u8[{B},{H},{H},3]"
    assert not [ln for ln in top if "conditional(" in ln], "a conditional around the writes"
    makes = (" fusion(", " copy(", " dynamic-slice(", " copy-start(")  # new memory, not aliases
    copied = [
        ln
        for ln in top
        if any(f"= {shape}" in ln for shape in (part_image, f"u8[1,{B},{H},{H},3]"))
        and any(op in ln for op in makes)
    ]
    assert not copied, copied  # no materialised copy of a part's image
    out = fn(state, stacked)  # and the writes happened, in place
    jaxtraj.raise_if_error(out)
    written = np.asarray(out.policy.obs["image"])[0, 0]  # source 0 (env rank 0), epoch 0
    np.testing.assert_array_equal(written, stacked[0].obs["image"])
