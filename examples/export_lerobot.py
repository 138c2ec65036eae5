"""Collect a few training steps in lerobot mode and write a LeRobot v3.0 dataset.

The point-mass environment of ``collect_rollout.py`` (episodes of at most 20 actions,
auto-reset inside chunks) runs ``B`` environments; each training step collects ``T``
chunks of ``K`` actions, so episodes cross training-step boundaries: the collector
keeps each environment's running episode on device and writes an episode once it
ends. One frame per executed action, showing the observation that action was taken from
(the env halves carry them: ``EnvPart.action_obs``).

Each observation also carries a 96x96 RGB camera, ``top``, rendered from the state (the
point mass as a disc moving over a shaded floor, the goal as a ring): the dataset gets a
``observation.images.top`` video feature (AV1, LeRobot's settings), encoded by the writer's
background threads while collection goes on.

    python examples/export_lerobot.py --root DIR [--steps 3] [--envs 8] [--chunks 8]
                                      [--camera video|image|none]

Load it with LeRobot (see docs/lerobot.md: ``LeRobotDataset(repo_id, root=DIR,
video_backend="pyav")``), or with pyarrow:
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

SIZE = 96  # camera pixels a side
_Y, _X = np.mgrid[:SIZE, :SIZE].astype(np.float32) / (SIZE - 1) * 2.4 - 1.2  # world coordinates


def render(state: np.ndarray) -> np.ndarray:
    """``[B, 4]`` states (position, goal) -> ``[B, 96, 96, 3]`` uint8 top views."""
    pos, goal = state[:, None, None, :2], state[:, None, None, 2:]
    to_pos = np.hypot(_X - pos[..., 0], _Y - pos[..., 1])
    to_goal = np.hypot(_X - goal[..., 0], _Y - goal[..., 1])
    disc = np.clip((0.15 - to_pos) / 0.03, 0, 1)  # soft edges: kinder to the codec
    ring = np.clip(1 - np.abs(to_goal - 0.2) / 0.03, 0, 1)
    floor = 0.35 + 0.15 * _X  # a shaded floor
    r = floor * (1 - disc) + 0.95 * disc
    g = np.maximum(floor * (1 - disc) + 0.3 * disc, ring)
    b = floor * (1 - disc) * (1 - ring) + 0.2 * disc
    return (np.stack([r, g, b], -1) * 255).round().clip(0, 255).astype(np.uint8)


def step_halves(params, env_state, flags, rng, *, step, T, camera=True):
    """The halves of one training step, the environments after it, and their last flags."""
    halves = []
    for chunk in range(T):
        key = TrajectoryKey(step, 0, 0, 0, chunk)
        policy_part, env_part, env_state, last, rng = run_chunk(
            params, env_state, rng, key, flags if chunk == 0 else None, per_action_obs=True
        )
        if camera:  # the camera of every observation: the chunk's and each action's
            obs, seen = policy_part.obs, env_part.action_obs
            policy_part = policy_part.replace(obs={**obs, "top": render(obs["state"])})
            views = render(seen["state"].reshape(-1, OBS)).reshape(
                seen["state"].shape[:2] + (SIZE, SIZE, 3)
            )
            env_part = env_part.replace(action_obs={**seen, "top": views})
        halves += [policy_part, env_part]
    return halves, env_state, last, rng


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="dataset folder (new or a jaxtraj dataset)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--camera",
        choices=["video", "image", "none"],
        default="video",
        help="store the 96x96 camera as a video feature, PNG images, or not at all",
    )
    args = parser.parse_args()
    camera = args.camera != "none"
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
    halves, env_state, flags, rng = step_halves(
        params, env_state, flags, rng, step=0, T=T, camera=camera
    )
    features = jaxtraj.lerobot.features(
        plan, halves[0], halves[1], cameras=args.camera if camera else "video"
    )
    writer = LeRobotWriter(args.root, fps=10, features=features, robot_type="point_mass")
    collector = jaxtraj.TrajectoryCollector(
        plan, halves[0], halves[1], writer=writer, tasks="reach the goal"
    )
    for step in range(args.steps):
        if step:
            halves, env_state, flags, rng = step_halves(
                params, env_state, flags, rng, step=step, T=T, camera=camera
            )
        random.Random(step).shuffle(halves)  # asynchronous arrival
        written = [ep for part in halves for _, eps in collector.add(part) for _, ep in eps]
        running = np.asarray(collector.mode_states[0].length)  # frames per env
        print(
            f"step {step}: {len(written)} episodes written "
            f"({sum(len(ep['action']) for ep in written)} frames); "
            f"running episodes carry {running.tolist()} frames into the next step"
        )
    writer.close()  # waits for the encoder threads: everything accepted is now committed
    videos = sorted(str(p.relative_to(writer.root)) for p in writer.root.glob("videos/*/*/*.mp4"))
    print(f"{args.root}: {writer.num_episodes} episodes, {writer.num_frames} frames")
    if videos:
        print(f"videos: {', '.join(videos)}")


if __name__ == "__main__":
    main()
