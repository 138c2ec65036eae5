"""Property: any arrival order and any fragmentation flush bit-identical trajectories."""

from __future__ import annotations

from helpers import PLAN, all_parts, assert_same, env_part, policy_part, reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxtraj

SPLITS = [[4], [1, 3], [2, 2], [3, 1], [1, 1, 2], [2, 1, 1], [1, 1, 1, 1]]
HALVES = all_parts(0) + all_parts(1)  # two sources, two epochs, interleaved
REFERENCE = {}


def _reference(env_rank):
    if env_rank not in REFERENCE:
        REFERENCE[env_rank] = reference(env_rank)
    return REFERENCE[env_rank]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    splits=st.lists(st.sampled_from(SPLITS), min_size=len(HALVES), max_size=len(HALVES)),
    data=st.data(),
)
def test_any_order_any_fragmentation_same_trajectory(splits, data):
    fragments = [f for half, sizes in zip(HALVES, splits) for f in half.split(sizes)]
    order = data.draw(st.permutations(range(len(fragments))))
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    out = []
    for i in order:
        out += c.add(fragments[i])
    assert sorted(int(t.env_rank) for _, t in out) == [0, 1]
    for _, t in out:
        assert_same(t, _reference(int(t.env_rank)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    splits=st.lists(st.sampled_from(SPLITS), min_size=len(HALVES), max_size=len(HALVES)),
    data=st.data(),
)
def test_stacked_batches_of_fragments_same_trajectory(splits, data):
    """The same through ``add_many`` with every batch stacked (the path many small parts
    take): fragments (a row offset) and whole rows, in any order and batching."""
    from jaxtraj import collector

    fragments = [f for half, sizes in zip(HALVES, splits) for f in half.split(sizes)]
    order = data.draw(st.permutations(range(len(fragments))))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(order) - 1), max_size=6)))
    saved, collector._STACK_AT_LEAST = collector._STACK_AT_LEAST, 1
    try:
        c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
        out = []
        for a, b in zip([0, *cuts], [*cuts, len(order)]):
            out += c.add_many([fragments[i] for i in order[a:b]])
    finally:
        collector._STACK_AT_LEAST = saved
    assert sorted(int(t.env_rank) for _, t in out) == [0, 1]
    for _, t in out:
        assert_same(t, _reference(int(t.env_rank)))
