"""Faults: a stalled source is named while the others flush; a re-sent half is refused,
or accepted once if identical (``resend="accept_identical"``)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from helpers import PLAN, B, all_parts, env_part, policy_part

import jaxtraj
from jaxtraj import CollectorError, ErrorCode


def test_a_stalled_source_is_named_and_the_others_flush():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    for p in all_parts(1)[:-2]:  # source 1 stops reporting before its last chunk
        c.add(p)
    c.check_stalled(timeout_s=60.0)  # not yet
    out = []
    for p in all_parts(0):
        out += c.add(p)
    assert len(out) == 1 and int(out[0][1].env_rank) == 0  # source 0 unaffected
    missing = [m for m in c.missing() if m[0][2] == 1]  # source 0 now waits for step 1
    assert {k for k, _, _ in missing} == {(0, 1, 1, 0, 2)}
    assert {(half, n) for _, half, n in missing} == {("policy", B), ("env", B)}
    with pytest.raises(CollectorError) as info:
        c.check_stalled(timeout_s=60.0, now=1e12)
    assert info.value.code == ErrorCode.SOURCE_TIMEOUT
    assert "(0, 1, 1, 0, 2)" in str(info.value) and info.value.key == (0, -1, 1, 0, -1)
    out = []
    for p in all_parts(1)[-2:]:  # late parts are still welcome
        out += c.add(p)
    assert len(out) == 1


def test_a_resent_half_is_rejected_or_accepted_once_if_identical():
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    c.add(policy_part(0))
    with pytest.raises(CollectorError, match="duplicate"):
        c.add(policy_part(0))
    lenient = dataclasses.replace(PLAN, resend="accept_identical")
    c = jaxtraj.TrajectoryCollector(lenient, policy_part(0), env_part(0))
    c.add(policy_part(0))
    c.add(env_part(0))
    before = [np.array(x) for x in jax.tree.leaves(c.state)]
    assert c.add(policy_part(0)) == []  # the same data again: accepted, changes nothing
    assert c.add(env_part(0).split([2, 2])[1]) == []  # an identical fragment of it too
    for x, y in zip(before, jax.tree.leaves(c.state)):
        np.testing.assert_array_equal(x, y)
    changed = policy_part(0).replace(
        obs={**policy_part(0).obs, "state": policy_part(0).obs["state"] + 1}
    )
    with pytest.raises(CollectorError, match="duplicate"):
        c.add(changed)
    out = []
    for p in all_parts(0)[2:]:
        out += c.add(p)
    assert len(out) == 1
