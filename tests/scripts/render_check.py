"""A MuJoCo camera through AsyncRunner: the env built by a factory in its own thread, or in
its own process (env_workers="process"), gives the frames the main thread renders; printed as JSON. Run with MUJOCO_GL set (osmesa here)
before MuJoCo loads; prints {"unavailable": reason} where this machine cannot render."""

from __future__ import annotations

import json
import sys

import numpy as np

B, K, T, SIDE = 2, 2, 3, 48


def make_vec():
    import gymnasium as gym
    from gymnasium.vector import SyncVectorEnv
    from gymnasium.wrappers import AddRenderObservation

    def one():
        env = gym.make("InvertedPendulum-v5", render_mode="rgb_array", width=SIDE, height=SIDE)
        return AddRenderObservation(env, render_only=False)  # obs {"state", "pixels"}

    return SyncVectorEnv([one for _ in range(B)])


def make_env():
    from jaxtraj.envs import GymnasiumEnv

    return GymnasiumEnv(make_vec(), actions_per_chunk=K, obs_key=None, seed=7)


def main():
    try:
        probe = make_vec()
        probe.reset(seed=0)
        probe.close()
    except Exception as exc:  # no GL backend: the test skips, saying why
        print(json.dumps({"unavailable": f"{type(exc).__name__}: {exc}"}))
        return
    import jax

    import jaxtraj
    from jaxtraj.envs import example_parts
    from jaxtraj.runners.threads import AsyncRunner

    def policy_fn(params, obs, rng):
        return jaxtraj.PolicyOutput(actions=np.full((B, K, 1), 0.1, np.float32))

    # The main thread's frames: the same env, seeds and actions, stepped here (twice: two
    # renders of the same states differ a little, which bounds what "the same" can mean).
    def main_thread_frames():
        ref_env = make_env()
        obs = ref_env.reset()
        frames = []
        for _ in range(T):
            frames.append(obs["pixels"])
            obs = ref_env.step(None, policy_fn(None, obs, None).actions).obs
        ref_env.close()
        return np.stack(frames)

    want, again = main_thread_frames(), main_thread_frames()

    plan = jaxtraj.TrajectoryPlan(num_chunks=T, batch_size=B)
    example_env = make_env()
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), example_env.spec().obs)
    parts = example_parts(example_env, plan, policy_fn(None, zeros, None))
    collector = jaxtraj.TrajectoryCollector(plan, *parts)
    out = {}
    cases = (("factory", [make_env], "thread"), ("process", [make_env], "process"),
             ("built_in_main", [example_env], "thread"))
    for name, envs, workers in cases:
        collector = jaxtraj.TrajectoryCollector(plan, *parts)
        runner = AsyncRunner(collector, envs, policy_fn, None, env_workers=workers)
        (_, traj), = runner.run()
        got = np.asarray(traj.obs["pixels"])[0]  # [T, B, H, W, 3]
        diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
        out[name] = {"mean": float(got.mean()), "mad": float(diff.mean())}
        if name != "built_in_main":  # a call to the env from this thread, served where it lives
            frames = runner.envs[0].render()  # the vector env's: a frame per sub-env
            out[name]["render"] = [len(frames), *np.shape(frames[0]), float(np.mean(frames))]
        runner.close()
    example_env.close()
    out["main_mean"] = float(want.mean())
    out["main_mad"] = float(np.abs(want.astype(np.int16) - again.astype(np.int16)).mean())
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
