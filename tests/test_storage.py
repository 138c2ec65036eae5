"""Where a step's bytes live: one copy in, no copy out, and nothing written behind a holder."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import PLAN, all_parts, assert_same, env_part, policy_part, reference

import jaxtraj
from jaxtraj import CollectorError, ErrorCode, storage
from jaxtraj.storage import aligned_zeros

pointer = lambda x: np.asarray(x).ctypes.data  # zero-copy view of a CPU array


def test_staging_is_aligned_for_zero_copy_transfer():
    for shape, dtype in (((3, 5), np.float32), ((7,), np.uint8), ((2, 3, 4), np.int64)):
        a = aligned_zeros(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.ctypes.data % 64 == 0
        assert not a.any()


def test_to_device_is_device_put():
    """The flush's transfer (XLA's batched put, not ``jax.device_put``'s Python) gives what
    ``jax.device_put`` gives: values, dtypes (int64 canonicalised without x64), sharding,
    an uncommitted array; aligned CPU memory is adopted, not copied."""
    aligned = aligned_zeros((4, 5), np.float32)
    aligned[:] = 1.5
    tree = {
        "a": aligned,
        "b": np.arange(6, dtype=np.int64).reshape(2, 3),
        "c": np.array([True, False]),
        "d": np.float32(2.0),
        "e": np.arange(3, dtype=np.uint8)[::2],  # not contiguous
        "f": jax.numpy.ones(2),
    }
    # The fast entry point is internal to JAX: its probe must pass on the JAX we test with
    # (otherwise every flush silently pays jax.device_put's ~20 us an array again).
    assert storage._fast_put() is not None
    got, want = storage.to_device(tree), jax.device_put(tree)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert isinstance(g, jax.Array)
        assert g.dtype == w.dtype and g.shape == w.shape and g.sharding == w.sharding
        assert g.committed == w.committed
        np.testing.assert_array_equal(g, w)
    if jax.default_backend() == "cpu":
        assert got["a"].unsafe_buffer_pointer() == tree["a"].ctypes.data
    # An explicit transfer, as device_put's: allowed under a guard that forbids implicit ones.
    with jax.transfer_guard("disallow"):
        np.testing.assert_array_equal(storage.to_device(tree)["a"], aligned)
    # Canonical dtypes follow x64 as it is switched (int64 stays int64 only with x64 on).
    ints = np.arange(3, dtype=np.int64)
    with jax.enable_x64(True):
        assert storage.to_device(ints).dtype == jax.device_put(ints).dtype == np.int64
    assert storage.to_device(ints).dtype == jax.device_put(ints).dtype == np.int32


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="zero-copy adoption is the CPU client's")
def test_facade_flush_hands_over_the_staging_buffers_without_a_copy():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), storage="host")
    parts = all_parts(0)
    for p in parts[:-1]:
        assert c.add(p) == []
    staged = pointer(c.states[0].policy.obs["image"])
    ((_, traj),) = c.add(parts[-1])
    assert pointer(traj.obs["image"]) == staged  # no copy on the way out
    assert pointer(traj.forward_inputs["tokens"]) != staged
    assert pointer(c.states[0].policy.obs["image"]) != staged  # the next step has its own
    assert_same(traj, reference(0))


@pytest.mark.parametrize("storage", ["host", "device"])
def test_a_handed_out_trajectory_is_never_written_by_later_collection(storage):
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), storage=storage)
    (first,) = [t for p in all_parts(0) for _, t in c.add(p)]
    kept = jax.tree.map(np.array, first)  # a copy to compare with
    for step in (1, 2):  # the next steps reuse nothing the first one handed out
        out = [t for p in all_parts(0, step=step) for _, t in c.add(p)]
        assert len(out) == 1
    assert_same(first, kept)


@pytest.mark.parametrize("storage", ["host", "device"])
def test_rejected_part_changes_nothing_in_either_storage(storage):
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), storage=storage)
    parts = all_parts(0)
    for p in parts[:5]:
        c.add(p)
    before = jax.tree.map(np.array, c.state)
    with pytest.raises(CollectorError) as info:
        c.add(parts[0])  # the same half again
    assert info.value.code == ErrorCode.DUPLICATE
    after = jax.tree.map(np.array, c.state)
    assert_same(after, before)
    out = [t for p in parts[5:] for _, t in c.add(p)]
    assert_same(out[0], reference(0))


def test_pure_inserts_are_in_place_and_recycled_flush_copies_nothing():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    add = {
        jaxtraj.PolicyPart: jax.jit(jaxtraj.add_policy, static_argnums=0, donate_argnums=1),
        jaxtraj.EnvPart: jax.jit(jaxtraj.add_env, static_argnums=0, donate_argnums=1),
    }
    flush = jax.jit(jaxtraj.rollout.flush, static_argnums=0, donate_argnums=(1, 3))
    image = lambda st: st.policy.obs["image"].unsafe_buffer_pointer()
    first = image(state)
    for p in all_parts(0):
        state = add[type(p)](PLAN, state, p)
        assert image(state) == first  # donated: written in place
    traj0, state = flush(PLAN, state)  # no recycle yet: the state keeps a copy
    spare = traj0.obs["image"].unsafe_buffer_pointer()
    # Read through copies: jax.device_get (chex's comparison) keeps a NumPy view of each CPU
    # buffer since jax 0.11, and a buffer so viewed is copied when donated, not reused.
    kept0 = jax.tree.map(np.array, traj0)
    assert_same(kept0, reference(0))
    for p in all_parts(0, step=1):
        state = add[type(p)](PLAN, state, p)
    before = image(state)
    traj1, state = flush(PLAN, state, None, traj0)  # traj0 donated back
    assert traj1.obs["image"].unsafe_buffer_pointer() == before  # taken, not copied
    assert image(state) == spare  # the state continues in the recycled buffers
    assert_same(traj1, reference(0, step=1))
    for p in all_parts(0, step=2):
        state = add[type(p)](PLAN, state, p)
    traj2, state = flush(PLAN, state, None, traj1)
    assert_same(traj2, reference(0, step=2))
    jaxtraj.raise_if_error(state)
    del kept0


def test_recycle_must_be_a_trajectory_of_the_plan():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    with pytest.raises(ValueError, match="recycle"):
        functools.partial(jaxtraj.rollout.flush, PLAN)(state, None, {"x": np.zeros(3)})


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="zero-copy adoption is the CPU client's")
def test_staging_is_reused_only_once_nothing_holds_it():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), storage="host")
    staged = []

    def step(k):  # the staging is taken at the step's first half: the trajectory shows it
        (traj,) = [t for p in all_parts(0, step=k) for _, t in c.add(p)]
        staged.append(traj.obs["image"].unsafe_buffer_pointer())
        return traj

    held = step(0)  # kept by the caller
    kept = jax.tree.map(np.array, held)
    dropped = step(1)
    del dropped  # the caller is done with step 1's trajectory
    step(2)
    step(3)
    # Step 0's buffers were never reused while held; step 1's came back for step 2 (the
    # caller dropped its trajectory before step 2's first half), and step 2's for step 3.
    assert staged[0] not in staged[1:]
    assert staged[1] == staged[2] == staged[3]
    assert_same(held, kept)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="zero-copy adoption is the CPU client's")
def test_staging_is_recycled_while_the_caller_holds_the_latest_trajectory():
    """An Actor that trains on step k's trajectory while step k + 1 is collected (it
    drops step k's only when step k + 1's arrives) still gets recycled staging, and
    the trajectory it holds is never written."""
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), storage="host")
    staged, held, kept = [], None, None
    for k in range(6):
        (traj,) = [t for p in all_parts(0, step=k) for _, t in c.add(p)]
        staged.append(traj.obs["image"].unsafe_buffer_pointer())  # zero-copy: the staging
        if held is not None:
            assert_same(held, kept)  # not written while held
        held, kept = traj, jax.tree.map(np.array, traj)
        assert_same(held, reference(0, step=k))
    # Two buffers take turns: step k's trajectory is held while step k + 1 is collected,
    # and step k - 1's, dropped by then, gives its buffers back.
    assert len(set(staged)) == 2
    assert staged[2:] == staged[:-2]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="zero-copy adoption is the CPU client's")
def test_the_most_recently_handed_out_free_staging_is_taken():
    """Of several free spares, the next step takes the latest one's (its memory is the
    warmest); at most SPARES stay allocated beside the step being collected."""
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0), storage="host")

    def step(k):
        (traj,) = [t for p in all_parts(0, step=k) for _, t in c.add(p)]
        return traj

    held = [step(k) for k in range(3)]  # all held: three buffers
    staged = [t.obs["image"].unsafe_buffer_pointer() for t in held]
    assert len(set(staged)) == 3
    del held  # all dropped
    assert step(3).obs["image"].unsafe_buffer_pointer() == staged[2]
    c.states  # noqa: B018 - takes step 4's staging
    assert len(c._store._spares[0]) <= storage.SPARES
