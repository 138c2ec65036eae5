"""RLT: only z_rl, proprio and ref_chunk are retained, for the current and next state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import PLAN, A, B, E, K, T, all_parts, env_part, policy_part

import jaxtraj
from jaxtraj import CollectorError, ErrorCode

RLT = dataclasses.replace(PLAN, num_env_ranks=1, enable_rlt=True)


def features(chunk, epoch, salt=0.0):
    base = 10 * epoch + chunk + salt
    return {
        "z_rl": np.full((B, 4), base, np.float32),
        "proprio": np.full((B, 3), -base, np.float32),
        "ref_chunk": np.full((B, K * A), base / 2, np.float32),
    }


def rlt_policy(chunk, epoch=0):
    p = policy_part(chunk, epoch)
    inputs = {**p.output.forward_inputs, **features(chunk, epoch)}
    return p.replace(output=p.output.replace(forward_inputs=inputs))


def rlt_env(chunk, epoch=0, flags=None):
    v = env_part(chunk, epoch)
    if chunk == T - 1:  # the next policy's inputs are not in this step: Env sends them
        v = v.replace(next_rlt_obs=features(0, epoch, salt=0.5))
    if flags is not None:
        tr = v.transition.replace(
            intervene_actions=np.full((B, K * A), 7.0, np.float32), intervene_flags=flags
        )
        v = v.replace(transition=tr)
    return v


def test_next_state_features_and_interventions_on_ref_chunk():
    no = np.zeros((B, K), bool)
    flags = no.copy()
    flags[2, 1] = True
    c = jaxtraj.TrajectoryCollector(RLT, rlt_policy(0), rlt_env(0, flags=no))
    out = []
    for e in range(E):
        for t in range(T):
            out += c.add(rlt_policy(t, e))
            out += c.add(rlt_env(t, e, flags=flags if (e, t) == (0, 1) else no))
    traj = out[0][1]
    assert set(traj.rlt_obs) == set(traj.next_rlt_obs) == {"z_rl", "proprio", "ref_chunk"}
    for e in range(E):
        for t in range(T):
            np.testing.assert_array_equal(traj.rlt_obs["z_rl"][e, t], features(t, e)["z_rl"])
            want = features(t + 1, e) if t < T - 1 else features(0, e, salt=0.5)
            np.testing.assert_array_equal(traj.next_rlt_obs["proprio"][e, t], want["proprio"])
    # The executed chunk (human action 1 of env 2) is the retained reference chunk.
    ref = traj.rlt_obs["ref_chunk"][0, 1].reshape(B, K, A)
    np.testing.assert_array_equal(ref[2, 1], 7.0)
    np.testing.assert_array_equal(ref[2, 0], features(1, 0)["ref_chunk"][2, 0])
    np.testing.assert_array_equal(ref[0], features(1, 0)["ref_chunk"][0].reshape(K, A))


def test_rlt_needs_its_keys_and_the_last_next_state():
    with pytest.raises(CollectorError, match="missing \\['z_rl', 'proprio', 'ref_chunk'\\]"):
        jaxtraj.TrajectoryCollector(RLT, policy_part(0), env_part(0))
    c = jaxtraj.TrajectoryCollector(RLT, rlt_policy(0), rlt_env(0))
    with pytest.raises(CollectorError) as info:
        c.add(env_part(T - 1))
    assert info.value.code == ErrorCode.MISSING_NEXT_OBS
    with pytest.raises(CollectorError, match="z_rl"):
        c.add(policy_part(1))  # forward inputs without the RLT keys: not the plan's structure


def test_off_it_costs_nothing():
    state = jaxtraj.init(PLAN, policy_part(0), env_part(0), sources=(0, 0))
    assert state.env.next_rlt_obs is None and state.next_rlt_given is None
    c = jaxtraj.TrajectoryCollector(
        dataclasses.replace(PLAN, num_env_ranks=1), policy_part(0), env_part(0)
    )
    ((_, traj),) = [x for p in all_parts(0) for x in c.add(p)]
    assert traj.rlt_obs is None and traj.next_rlt_obs is None
