"""Run by tests/test_multidevice.py with 8 simulated CPU devices (XLA_FLAGS set before JAX
starts).

1. ``pmap`` over sources: single-source states stacked on a leading axis, one source per
   device; ``jaxtraj.add_policy`` / ``add_env`` and then ``jaxtraj.rollout.flush`` pmapped
   over it give the facade's trajectories.
2. Pipeline mode: sources sharded over a ``sources`` mesh axis, micro-batches over an
   ``actor`` axis: the output equals a single-device flush of the same data, and covers
   every sample once.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax
import numpy as np

# The same strict numerics as tests/conftest.py, which a subprocess does not load.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
from helpers import PLAN, all_parts, assert_same, env_part, policy_part, reference  # noqa: E402

import jaxtraj  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()

# -- 1. pmap over sources, one per device -------------------------------------------------
S = len(jax.devices())
plan_s = dataclasses.replace(PLAN, num_env_ranks=S)
stack = lambda ps: jax.tree.map(lambda *xs: np.stack(xs), *ps)
sources = np.array([[r, 0] for r in range(S)], np.int32)
states = jax.pmap(lambda src: jaxtraj.init(plan_s, policy_part(0), env_part(0), sources=src))(
    sources
)
add_p = jax.pmap(functools.partial(jaxtraj.add_policy, plan_s), donate_argnums=0)
add_e = jax.pmap(functools.partial(jaxtraj.add_env, plan_s), donate_argnums=0)
for e in range(plan_s.num_epochs):
    for t in range(plan_s.num_chunks):
        states = add_p(states, stack([policy_part(t, e, r) for r in range(S)]))
        states = add_e(states, stack([env_part(t, e, r) for r in range(S)]))
assert np.all(jax.pmap(jaxtraj.rollout.ready)(states))
trajs, states = jax.pmap(functools.partial(jaxtraj.rollout.flush, plan_s))(states)
np.testing.assert_array_equal(states.step, np.ones(S))
np.testing.assert_array_equal(states.error_code, np.zeros(S))
facade = jaxtraj.TrajectoryCollector(plan_s, policy_part(0), env_part(0))
want = dict(
    (int(t.env_rank), t)
    for p in [p for r in range(S) for p in all_parts(r)]
    for _, t in facade.add(p)
)
assert sorted(want) == list(range(S))
assert_same(want[0], reference(0))  # the helpers' reference (a plan with 2 sources)
for r in range(S):
    assert_same(jax.tree.map(lambda x, r=r: x[r], trajs), want[r])
print("pmap over sources == facade")

# -- 2. pipeline mode, sharded ------------------------------------------------------------
plan = dataclasses.replace(
    PLAN, mode="pipeline", num_env_ranks=4, actor_ranks=4, micro_batch_size=6
)
parts = [p for r in range(4) for p in all_parts(r)]
order = np.random.default_rng(0).permutation(len(parts))


def run(mesh, storage="host"):
    c = jaxtraj.TrajectoryCollector(
        plan, policy_part(0), env_part(0), rng=jax.random.PRNGKey(7), mesh=mesh, storage=storage
    )
    out = c.add_many([parts[i] for i in order])
    return c, out


mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("sources", "actor"))
single_c, single = run(None)
sharded_c, sharded = run(mesh)
on_device_c, on_device = run(mesh, "device")  # jitted inserts into the sharded state
state_spec = on_device_c.states[0].policy.obs["image"].sharding.spec
assert state_spec[0] == "sources", state_spec
assert len(single) == len(sharded) == len(on_device) == plan.num_epochs * plan.actor_ranks
for (k1, a), (k2, b), (k3, d) in zip(single, sharded, on_device):
    assert k1 == k3
    jax.tree.map(np.testing.assert_array_equal, b, d)
    assert k1 == k2
    for name in (
        "obs",
        "actions",
        "prev_logprobs",
        "prev_values",
        "forward_inputs",
        "loss_mask",
        "returns",
    ):
        jax.tree.map(np.testing.assert_array_equal, getattr(a, name), getattr(b, name))
    np.testing.assert_allclose(a.advantages, b.advantages, rtol=1e-6, atol=1e-6)
# every valid sample exactly once per epoch
for epoch in range(plan.num_epochs):
    items = sharded[epoch * 4 : (epoch + 1) * 4]
    n = sum(int(np.asarray(mb.loss_mask).sum()) for _, mb in items)
    assert n == 4 * plan.num_chunks * plan.batch_size, n
# The pure flush leaves every micro-batch leaf sharded over the actor axis, sources
# sharded over the sources axis.
c = jaxtraj.TrajectoryCollector(plan, policy_part(0), env_part(0), mesh=mesh, auto_flush=False)
c.add_many(parts)
flush = jaxtraj.pipeline.make_flush(plan, mesh)
state = jaxtraj.pipeline.shard_state(jax.device_put(c.states[0]), mesh)
batches, state, _ = flush(state, jaxtraj.pipeline.init(plan, jax.random.PRNGKey(0)), 0)
for leaf in jax.tree.leaves(batches):
    assert leaf.sharding.spec[0] == "actor", leaf.sharding
    assert leaf.shape[0] == plan.actor_ranks
assert state.policy.output.actions.sharding.spec[0] == "sources"
# Recycling the micro-batches under the mesh: the same output, still sharded over the actor
# axis, and no all-gather of the state's big buffers (the row loop is for one device only).
pipe = jaxtraj.pipeline.init(plan, jax.random.PRNGKey(0))
state = jaxtraj.pipeline.shard_state(jax.device_put(c.states[0]), mesh)
fresh, _, _ = jaxtraj.pipeline.make_flush(plan, mesh, donate=False)(state, pipe, 0)
hlo = flush.lower(state, pipe, 0, 0, batches).compile().as_text()
assert not any("all-gather" in line and "u8[" in line for line in hlo.splitlines()), "image gathered"
again, state, _ = flush(state, pipe, 0, 0, batches)
jax.tree.map(np.testing.assert_array_equal, jax.device_get(fresh), jax.device_get(again))
for leaf in jax.tree.leaves(again):
    assert leaf.sharding.spec[0] == "actor", leaf.sharding
print("sharded == single-device")

# -- 3. per-rank advantage normalisation, sharded, against NumPy ------------------------------
# Each Actor rank's valid advantages are normalised over that rank's batches only: the
# sharded flush (ranks over the actor axis) against a NumPy normalisation of the same
# samples' raw advantages, flushed on one device.
per_rank = dataclasses.replace(plan, normalize_advantages="per_rank")
raw_plan = dataclasses.replace(plan, normalize_advantages="none")


def run_plan(p, mesh):
    c = jaxtraj.TrajectoryCollector(p, policy_part(0), env_part(0), rng=jax.random.PRNGKey(7), mesh=mesh)
    return c.add_many([parts[i] for i in order])


raw, got = run_plan(raw_plan, None), run_plan(per_rank, mesh)
assert [k for k, _ in raw] == [k for k, _ in got] and len(got) == plan.num_epochs * plan.actor_ranks
for (_, u), (_, g) in zip(raw, got):
    mask = np.asarray(u.loss_mask)
    a = np.asarray(u.advantages)[mask]
    want = np.zeros_like(np.asarray(u.advantages))
    want[mask] = (a - a.mean()) / (np.sqrt(((a - a.mean()) ** 2).mean()) + 1e-8)
    np.testing.assert_allclose(np.asarray(g.advantages), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(g.loss_mask), mask)
print("per-rank normalisation, sharded == NumPy")
