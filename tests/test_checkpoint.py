"""Checkpoint and restore: bit-identical resumption, and refusal of what does not match."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import PLAN, B, T, all_parts, env_part, policy_part

import jaxtraj
from jaxtraj import checkpoint


def first_of_step():
    """Half of source 0's step, with partial slots and a routed fragment."""
    parts = all_parts(0)
    return parts[:5] + [parts[5].split([1, 3])[0]]


def rest_of_step():
    parts = all_parts(0)
    return [parts[5].split([1, 3])[1]] + parts[6:]


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_restore_in_a_fresh_process_flushes_bit_identically(tmp_path):
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    for p in first_of_step() + all_parts(1)[:3]:  # source 1 partial too
        assert c.add(p) == []
    checkpoint.save(c, tmp_path / "ckpt")
    expect = []
    for p in rest_of_step():
        expect += c.add(p)
    out = tmp_path / "traj.npz"
    script = Path(__file__).with_name("checkpoint_resume.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = np.load(out)
    want = leaves(expect[0][1])
    assert len(got.files) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[f"arr_{i}"], w)


def test_pipeline_and_lerobot_state_round_trip(tmp_path):
    pipe = dataclasses.replace(PLAN, mode="pipeline", actor_ranks=2)
    parts = all_parts(0) + all_parts(1)
    whole = jaxtraj.TrajectoryCollector(
        pipe, policy_part(0), env_part(0), rng=jax.random.PRNGKey(5)
    )
    expect = whole.add_many(parts)
    c = jaxtraj.TrajectoryCollector(pipe, policy_part(0), env_part(0), rng=jax.random.PRNGKey(5))
    got = c.add_many(parts[:14])  # epoch 0 of source 0 done, flushed epochs: none yet
    c.current_version = 3
    checkpoint.save(c, tmp_path / "pipe")
    r = checkpoint.restore(tmp_path / "pipe", pipe, policy_part(0), env_part(0))
    assert r.current_version == 3
    got += r.add_many(parts[14:])
    assert [k for k, _ in got] == [k for k, _ in expect]
    for (_, a), (_, b) in zip(got, expect):
        for x, y in zip(leaves(a), leaves(b)):
            np.testing.assert_array_equal(x, y)

    lr = dataclasses.replace(PLAN, mode="lerobot", num_env_ranks=1, max_episode_length=16)
    whole = jaxtraj.TrajectoryCollector(lr, policy_part(0), env_part(0))
    expect = [whole.add(p) for s in (0, 1) for p in all_parts(step=s)]
    c = jaxtraj.TrajectoryCollector(lr, policy_part(0), env_part(0))
    got = [c.add(p) for p in all_parts(step=0)]
    assert c.episodes_in_progress().sum() > 0  # episodes running across the step boundary
    checkpoint.save(c, tmp_path / "lerobot")
    r = checkpoint.restore(tmp_path / "lerobot", lr, policy_part(0), env_part(0))
    np.testing.assert_array_equal(r.episodes_in_progress(), c.episodes_in_progress())
    got += [r.add(p) for p in all_parts(step=1)]
    flat = lambda items: [
        x for item in items for _, eps in item for b, ep in eps for x in [b, *leaves(ep)]
    ]
    for x, y in zip(flat(got), flat(expect), strict=True):
        np.testing.assert_array_equal(x, y)


def test_other_plan_and_damaged_checkpoints_are_refused(tmp_path):
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    for p in first_of_step():
        c.add(p)
    checkpoint.save(c, tmp_path / "ck")
    with pytest.raises(checkpoint.CheckpointError, match="another plan"):
        checkpoint.restore(
            tmp_path / "ck",
            dataclasses.replace(PLAN, num_chunks=T + 1),
            policy_part(0),
            env_part(0),
        )
    with pytest.raises(checkpoint.CheckpointError, match="other buffers"):
        odd = policy_part(0).replace(
            obs={**policy_part(0).obs, "extra": np.zeros((B, 1), np.float32)}
        )
        checkpoint.restore(tmp_path / "ck", PLAN, odd, env_part(0))
    with pytest.raises(checkpoint.CheckpointError, match="exists"):
        checkpoint.save(c, tmp_path / "ck")
    # Damage: flip bytes in every data file of the orbax checkpoint.
    files = [
        f for f in (tmp_path / "ck" / "state").rglob("*") if f.is_file() and f.stat().st_size > 64
    ]
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        for i in range(32, len(data), 97):
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="damaged"):
        checkpoint.restore(tmp_path / "ck", PLAN, policy_part(0), env_part(0))
    # Incomplete: the marker written last is missing.
    meta = tmp_path / "ck" / "jaxtraj.json"
    json.loads(meta.read_text())
    meta.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="not a complete"):
        checkpoint.restore(tmp_path / "ck", PLAN, policy_part(0), env_part(0))
