"""Checkpoint and restore: bit-identical resumption, and refusal of what does not match."""

from __future__ import annotations

import ast
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
    example = env_part(0, per_action=True)
    whole = jaxtraj.TrajectoryCollector(lr, policy_part(0), example)
    expect = [whole.add(p) for s in (0, 1) for p in all_parts(step=s, per_action=True)]
    c = jaxtraj.TrajectoryCollector(lr, policy_part(0), example)
    got = [c.add(p) for p in all_parts(step=0, per_action=True)]
    assert np.asarray(c.mode_states[0].length).sum() > 0  # episodes running across the step boundary
    checkpoint.save(c, tmp_path / "lerobot")
    r = checkpoint.restore(tmp_path / "lerobot", lr, policy_part(0), example)
    np.testing.assert_array_equal(np.asarray(r.mode_states[0].length), np.asarray(c.mode_states[0].length))
    got += [r.add(p) for p in all_parts(step=1, per_action=True)]
    flat = lambda items: [
        x for item in items for _, eps in item for b, ep in eps for x in [b, *leaves(ep)]
    ]
    for x, y in zip(flat(got), flat(expect), strict=True):
        np.testing.assert_array_equal(x, y)


def saved(tmp_path, name="ck"):
    """A checkpoint of half a step (partial slots, a routed fragment), and its metadata."""
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), env_part(0))
    for p in first_of_step():
        c.add(p)
    checkpoint.save(c, tmp_path / name)
    return c, tmp_path / name, json.loads((tmp_path / name / checkpoint.META).read_text())


def restore(path):
    return checkpoint.restore(path, PLAN, policy_part(0), env_part(0))


def edit_meta(path, meta):
    (path / checkpoint.META).write_text(json.dumps(meta))


def test_other_plan_and_layout_are_refused(tmp_path):
    c, path, meta = saved(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary left behind
    with pytest.raises(checkpoint.CheckpointError, match="another plan"):
        checkpoint.restore(
            path, dataclasses.replace(PLAN, num_chunks=T + 1), policy_part(0), env_part(0)
        )
    odd = policy_part(0).replace(obs={**policy_part(0).obs, "extra": np.zeros((B, 1), np.float32)})
    with pytest.raises(checkpoint.CheckpointError, match="other buffers"):
        checkpoint.restore(path, PLAN, odd, env_part(0))
    with pytest.raises(checkpoint.CheckpointError, match="exists"):
        checkpoint.save(c, path)
    edit_meta(path, {**meta, "format": 1})
    with pytest.raises(checkpoint.CheckpointError, match="format 1, expected 2"):
        restore(path)


def test_incomplete_and_damaged_checkpoints_are_refused(tmp_path):
    _, path, _ = saved(tmp_path)
    data = (path / checkpoint.ARRAYS).read_bytes()
    flipped = bytearray(data)
    for i in range(0, len(flipped), 97):
        flipped[i] ^= 0xFF
    (path / checkpoint.ARRAYS).write_bytes(bytes(flipped))
    with pytest.raises(checkpoint.CheckpointError, match="fail their checksum"):
        restore(path)
    (path / checkpoint.ARRAYS).write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        restore(path)
    (path / checkpoint.ARRAYS).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="not a complete"):
        restore(path)
    (path / checkpoint.META).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="not a complete"):
        restore(path)


def test_an_edited_checksum_list_is_refused(tmp_path):
    """Every array needs its own checksum, found by its path: none skipped, none reused."""
    _, path, meta = saved(tmp_path)
    restore(path)  # intact
    name = max(meta["arrays"], key=lambda n: meta["arrays"][n]["nbytes"])
    entry = meta["arrays"][name]
    dropped = {k: v for k, v in entry.items() if k != "crc32"}
    edit_meta(path, {**meta, "arrays": {**meta["arrays"], name: dropped}})
    with pytest.raises(checkpoint.CheckpointError, match="no checksum for array") as info:
        restore(path)
    assert name in str(info.value)
    changed = {**entry, "crc32": entry["crc32"] ^ 1}
    edit_meta(path, {**meta, "arrays": {**meta["arrays"], name: changed}})
    with pytest.raises(checkpoint.CheckpointError, match="fail their checksum") as info:
        restore(path)
    assert name in str(info.value)
    fewer = {n: e for n, e in meta["arrays"].items() if n != name}
    edit_meta(path, {**meta, "arrays": fewer})
    with pytest.raises(checkpoint.CheckpointError, match="not in the checkpoint") as info:
        restore(path)
    assert name in str(info.value)


def test_an_array_rewritten_with_other_valid_values_is_refused(tmp_path):
    """The file reads fine and every layout check passes: only the CRC32 can tell."""
    _, path, meta = saved(tmp_path)
    numeric = {n: e for n, e in meta["arrays"].items() if e["dtype"] != "bool" and e["nbytes"]}
    name = max(numeric, key=lambda n: numeric[n]["nbytes"])
    offset, nbytes, dtype = (numeric[name][k] for k in ("offset", "nbytes", "dtype"))
    data = bytearray((path / checkpoint.ARRAYS).read_bytes())
    values = np.frombuffer(data[offset : offset + nbytes], np.dtype(dtype))
    data[offset : offset + nbytes] = (values + 1).astype(values.dtype).tobytes()
    (path / checkpoint.ARRAYS).write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="1 array.s. fail their checksum") as info:
        restore(path)
    assert name in str(info.value)


def test_checkpoint_reads_no_private_attribute():
    """The collector is reached through its public members only (state_dict and co.)."""
    tree = ast.parse(Path(checkpoint.__file__).read_text())
    private = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]
    assert private == []
