"""The examples run end to end (each in its own process, as a user runs them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(script, *args):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_collect_rollout_prints_what_the_actor_receives():
    out = run("collect_rollout.py", "--envs", "4", "--chunks", "4", "--epochs", "1")
    assert out.count("queue 'default': Trajectory(step=0") == 2
    assert ".prev_values" in out and "GAE advantages" in out


def test_export_lerobot_writes_episodes_across_steps(tmp_path):
    import pyarrow.parquet as pq

    root = tmp_path / "dataset"
    out = run(
        "export_lerobot.py", "--root", str(root), "--steps", "3", "--envs", "4", "--chunks", "8"
    )
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_episodes"] > 0
    # Steps end with episodes still running (carried into the next step).
    carried = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(carried) == 3 and "carry [0, 0, 0, 0]" not in carried[0]
    episodes = pq.read_table(root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    lengths = episodes.column("length").to_pylist()
    assert sum(lengths) == info["total_frames"]
    # Every frame collected is either written or still running; frames carried out of
    # step 0 belong to episodes that end in a later step.
    carry = [json.loads(line.split("carry ")[1].split(" frames")[0]) for line in carried]
    assert sum(carry[0]) > 0
    assert info["total_frames"] + sum(carry[-1]) == 3 * 8 * 4 * 4  # steps x chunks x K x envs


def test_async_and_decoupled_runner_examples_collect_two_steps():
    for flags in ([], ["--decoupled"]):  # decoupled: next step's halves arrive early, are held
        out = run("async_runner.py", "--steps", "2", *flags)
        assert out.count("  step ") == 4, out


def test_sync_runner_example():
    out = run("sync_runner.py")
    assert (
        out.count("step ") == 3 and "truncations 32" in out
    )  # the time limit ends step 1 (and is step 2's d_before)


def test_gymnasium_mujoco_example_trains_through_the_adapter_and_async_runner():
    out = run("gymnasium_mujoco.py", "--iterations", "3", "--envs", "2")
    iters = [line for line in out.splitlines() if line.startswith("iter ")]
    assert len(iters) == 3 and "versions [2]" in iters[-1], out  # one version per step


def test_ray_mujoco_example_runs_through_the_adapter():
    out = run("ray_mujoco.py", "--iterations", "2", "--envs", "2", "--actor-cpus", "0.5")
    assert out.count("iter ") == 2 and "versions [1]" in out, out
    # auto: direct for every actor that reaches the learner (on one machine, all)
    assert "(transports by rank {0: 'direct', 1: 'direct'})" in out, out
