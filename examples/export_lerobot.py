"""Collect a few training steps in lerobot mode and write a LeRobot v3.0 dataset.

The point-mass environment of ``collect_rollout.py`` (episodes of at most 20 actions,
auto-reset inside chunks) runs ``B`` environments; each training step collects ``T``
chunks of ``K`` actions, so episodes cross training-step boundaries: the collector
keeps each environment's running episode on device and writes an episode once it
ends. One frame per executed action.

    python examples/export_lerobot.py --root DIR [--steps 3] [--envs 8] [--chunks 8]

Load it with LeRobot (see docs/lerobot.md), or with pyarrow:
``pyarrow.parquet.read_table(DIR / "data/chunk-000/file-000.parquet")``.
"""

from __future__ import annotations

import argparse
import random

import jax
import numpy as np
from collect_rollout import OBS, A, K, env_reset, run_chunk

import jaxtraj
from jaxtraj import TrajectoryKey
from jaxtraj.lerobot import LeRobotWriter


def step_halves(params, env_state, flags, rng, *, step, T):
    """The halves of one training step, the environments after it, and their last flags."""
    halves = []
    for chunk in range(T):
        key = TrajectoryKey(step, 0, 0, 0, chunk)
        policy_part, env_part, env_state, last, rng = run_chunk(
            params, env_state, rng, key, flags if chunk == 0 else None
        )
        halves += [policy_part, env_part]
    return halves, env_state, last, rng


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="dataset folder (new or a jaxtraj dataset)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    B, T = args.envs, args.chunks
    plan = jaxtraj.TrajectoryPlan(
        num_chunks=T, batch_size=B, mode="lerobot", lerobot_frame="action", max_episode_length=64
    )
    rng = jax.random.PRNGKey(args.seed)
    params = {
        "w": 0.1 * jax.random.normal(rng, (OBS, K * A)),
        "v": 0.5 * jax.random.normal(jax.random.fold_in(rng, 1), (OBS,)),
    }
    env_state = env_reset(jax.random.fold_in(rng, 2), B)
    flags = (np.zeros((B, K), bool), np.zeros((B, K), bool))
    halves, env_state, flags, rng = step_halves(params, env_state, flags, rng, step=0, T=T)
    features = jaxtraj.lerobot.features(plan, halves[0], halves[1])
    writer = LeRobotWriter(args.root, fps=10, features=features, robot_type="point_mass")
    collector = jaxtraj.TrajectoryCollector(
        plan, halves[0], halves[1], writer=writer, tasks="reach the goal"
    )
    for step in range(args.steps):
        if step:
            halves, env_state, flags, rng = step_halves(
                params, env_state, flags, rng, step=step, T=T
            )
        random.Random(step).shuffle(halves)  # asynchronous arrival
        written = [ep for part in halves for _, eps in collector.add(part) for _, ep in eps]
        running = np.asarray(collector.mode_states[0].length)  # frames per env
        print(
            f"step {step}: {len(written)} episodes written "
            f"({sum(len(ep['action']) for ep in written)} frames); "
            f"running episodes carry {running.tolist()} frames into the next step"
        )
    print(f"{args.root}: {writer.num_episodes} episodes, {writer.num_frames} frames")


if __name__ == "__main__":
    main()
