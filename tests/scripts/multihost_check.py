"""Run by test_multihost.py as 2 processes on loopback (jax.distributed, gloo on CPU),
each with 4 simulated CPU devices: argv = process id, coordinator port.

Each process owns two of the four environment ranks and inserts only their parts; the
pipeline flush forms global arrays over a mesh spanning both processes. Every shard a
process holds equals the same slice of a single-process flush of all sources.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

pid, port = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
# The same strict numerics as tests/conftest.py, which a subprocess does not load.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for helpers
from helpers import PLAN, all_parts, env_part, policy_part  # noqa: E402

import jaxtraj  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 8
plan = dataclasses.replace(
    PLAN, mode="pipeline", num_env_ranks=4, actor_ranks=4, micro_batch_size=6
)
key = jax.random.PRNGKey(11)
mine = [(2 * pid, 0), (2 * pid + 1, 0)]
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("sources", "actor"))

# Single-process reference, on this process's own devices only.
with jax.default_device(jax.local_devices()[0]):
    ref = jaxtraj.TrajectoryCollector(plan, policy_part(0), env_part(0), rng=key, auto_flush=False)
    ref.add_many([p for r in range(4) for p in all_parts(r)])
    reference = [ref.flush(e) for e in range(plan.num_epochs)]

c = jaxtraj.TrajectoryCollector(
    plan, policy_part(0), env_part(0), sources=mine, rng=key, mesh=mesh, auto_flush=False
)
order = np.random.default_rng(pid).permutation(2 * len(all_parts(0)))
local_parts = [p for r, _ in mine for p in all_parts(r)]
for i in order:
    assert c.add(local_parts[i]) == []
assert c.ready() == list(range(plan.num_epochs))
checked = 0
for e in range(plan.num_epochs):
    # One item per Actor rank whose shards this process holds, as on one process.
    items = c.flush(e)
    want = dict(reference[e])
    # The mesh puts every actor column on each process (sources split the processes).
    assert [k for k, _ in items] == [f"actor_{r}" for r in range(plan.actor_ranks)]
    for queue_key, batches in items:
        for (path, got), w in zip(
            jax.tree_util.tree_flatten_with_path(batches)[0], jax.tree.leaves(want[queue_key])
        ):
            tol = 1e-6 if "advantages" in jax.tree_util.keystr(path) else 0
            np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=tol, atol=tol)
            checked += 1
assert c.current_step(*mine[0]) == 1  # the step advanced after its last epoch
print(f"process {pid}: {checked} shards == single-process flush", flush=True)

# Per-rank advantage normalisation across the two processes: each Actor rank's batches
# against a NumPy normalisation of the single-process raw advantages of the same samples.
raw_plan = dataclasses.replace(plan, normalize_advantages="none")
with jax.default_device(jax.local_devices()[0]):
    ref = jaxtraj.TrajectoryCollector(raw_plan, policy_part(0), env_part(0), rng=key, auto_flush=False)
    ref.add_many([p for r in range(4) for p in all_parts(r)])
    raw = [dict(ref.flush(e)) for e in range(plan.num_epochs)]
per_rank = dataclasses.replace(plan, normalize_advantages="per_rank")
c = jaxtraj.TrajectoryCollector(
    per_rank, policy_part(0), env_part(0), sources=mine, rng=key, mesh=mesh, auto_flush=False
)
for i in order:
    c.add(local_parts[i])
ranks = 0
for e in range(plan.num_epochs):
    for queue_key, batches in c.flush(e):
        u = raw[e][queue_key]
        mask = np.asarray(u.loss_mask)
        a = np.asarray(u.advantages)[mask]
        want = np.zeros_like(np.asarray(u.advantages))
        want[mask] = (a - a.mean()) / (np.sqrt(((a - a.mean()) ** 2).mean()) + 1e-8)
        np.testing.assert_allclose(np.asarray(batches.advantages), want, rtol=1e-5, atol=1e-5)
        ranks += 1
assert ranks == plan.num_epochs * plan.actor_ranks
print(f"process {pid}: per-rank normalisation == NumPy on {ranks} rank batches", flush=True)
jax.distributed.shutdown()
