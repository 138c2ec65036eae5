"""Run by test_multidevice.py with 8 simulated CPU devices (XLA_FLAGS set before JAX starts).

Sources sharded over a ``sources`` mesh axis, micro-batches over an ``actor`` axis: the
output equals a single-device flush of the same data, and covers every sample once.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from helpers import PLAN, all_parts, env_part, policy_part  # noqa: E402

import jaxtraj  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
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
print("sharded == single-device")
