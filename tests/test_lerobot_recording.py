"""What a LeRobot recording shows, end to end: a real gymnasium vector env (both autoreset
modes) through GymnasiumEnv, the collector in lerobot mode and the LeRobotWriter, read back
from the dataset's parquet and mp4 files.

The environment's per-action observations (state and a camera) and rewards encode
``(episode, frame)``; episodes end mid-chunk by termination (a success) or by a time limit
(a truncation, which the policy side bootstraps from ``V(final obs)``); a human intervenes
on some actions; one env rank is an expert's (policy halves without log-probabilities or
values). Every written frame must show the observation its action was taken from, the
action executed, the reward the environment gave (never the bootstrap), the flags and
success; every episode must start with its own reset observation; ending the recording
writes every frame.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxtraj
from jaxtraj import PolicyOutput, TrajectoryKey, TrajectoryPlan, TrajectorySource
from jaxtraj.envs import GymnasiumEnv, example_parts
from jaxtraj.runners.service import complete_env_part, env_part

gym = pytest.importorskip("gymnasium")
pytest.importorskip("av")

B, K, T, STEPS, RANKS, A, SIDE = 3, 3, 5, 3, 2, 2, 32
GAMMA, V = 0.5, 10.0


def code(rank, env, episode):
    """An episode's identity: rank, env and the env's episode count."""
    return 1000 * rank + 100 * env + episode


def pixel(ep_code, frame):
    return (7 * ep_code + 13 * frame) % 200 + 20  # a flat image per frame: easy on a codec


class Counting(gym.Env):
    """Observation ``state = [episode code, frame]`` and a flat camera whose value encodes
    both; reward ``100 * code + frame`` for the action taken at ``frame``. Episode ``i``
    lasts ``3 + (env + i) % 4`` actions and ends by termination (success) when ``i`` is
    even, by truncation when odd."""

    metadata = {"render_modes": []}

    def __init__(self, rank, env):
        self.rank, self.env, self.episode = rank, env, -1
        self.observation_space = gym.spaces.Dict(
            {
                "state": gym.spaces.Box(-np.inf, np.inf, (2,), np.float64),
                "top": gym.spaces.Box(0, 255, (SIDE, SIDE, 3), np.uint8),
            }
        )
        self.action_space = gym.spaces.Box(-10, 10, (A,), np.float32)

    def _obs(self):
        c = code(self.rank, self.env, self.episode)
        top = np.full((SIDE, SIDE, 3), pixel(c, self.frame), np.uint8)
        return {"state": np.array([c, self.frame], np.float64), "top": top}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.frame = 0
        return self._obs(), {}

    def step(self, action):
        reward = 100.0 * code(self.rank, self.env, self.episode) + self.frame
        self.frame += 1
        end = self.frame == 3 + (self.env + self.episode) % 4
        terminated = end and self.episode % 2 == 0
        truncated = end and not terminated
        return self._obs(), reward, terminated, truncated, {"is_success": terminated}


def make_env(rank, mode, chunk_end):
    from gymnasium.vector import SyncVectorEnv

    vec = SyncVectorEnv([lambda j=j: Counting(rank, j) for j in range(B)], autoreset_mode=mode)
    return GymnasiumEnv(
        vec, actions_per_chunk=K, obs_key=None, per_action_obs=True, success="is_success", seed=0,
        chunk_end=chunk_end,
    )


def policy_actions(rank, step, t):
    base = 1000 * rank + 100 * step + 10 * t
    return (base + np.arange(B * K * A, dtype=np.float32).reshape(B, K, A) / 100).astype(np.float32)


def record(root, mode, chunk_end="cut"):
    """A hand-written service loop (what a runner does), recording STEPS training steps
    of two ranks, then ending the recording. Returns what was executed, by frame: every
    action under "continue", the actions up to an episode's end under "cut"."""
    plan = TrajectoryPlan(
        num_chunks=T,
        batch_size=B,
        num_env_ranks=RANKS,
        mode="lerobot",
        gamma=GAMMA,
        max_episode_length=64,
        lerobot_state_key="state",
    )
    envs = [make_env(r, mode, chunk_end) for r in range(RANKS)]
    out_example = PolicyOutput(
        actions=np.zeros((B, K, A), np.float32),
        prev_logprobs=np.zeros((B, K, A), np.float32),
        prev_values=np.zeros((B,), np.float32),
    )
    p_ex, e_ex = example_parts(envs[0], plan, out_example)
    tr = e_ex.transition
    e_ex = e_ex.replace(
        transition=tr.replace(
            intervene_actions=np.zeros((B, K, A), np.float32),
            intervene_flags=np.zeros((B, K), bool),
        )
    )
    features = jaxtraj.lerobot.features(plan, p_ex, e_ex, cameras="video")
    writer = jaxtraj.lerobot.LeRobotWriter(root, fps=10, features=features)
    collector = jaxtraj.TrajectoryCollector(plan, p_ex, e_ex, writer=writer, tasks="count")
    value_fn = lambda params, obs: np.full((B,), V, np.float32)  # noqa: E731
    executed = {}  # (episode code, frame) -> the action executed there
    mid_chunk_ends = 0
    for r, env in enumerate(envs):
        obs, prev = env.reset(), None
        for step in range(STEPS):
            for t in range(T):
                key = TrajectoryKey(step, 0, r, 0, t)
                src = TrajectorySource(key, B, 0)
                actions = policy_actions(r, step, t)
                if r == 1:  # the expert's rank: its halves were not inferred
                    out = PolicyOutput(actions=actions)
                else:
                    out = PolicyOutput(
                        actions=actions,
                        prev_logprobs=-actions,
                        prev_values=np.full((B,), 1.0, np.float32),
                    )
                collector.add(jaxtraj.PolicyPart(src, obs, out))
                step_out = env.step(key, actions)
                # A human takes over action 1 of env 0 on even chunks.
                flags = np.zeros((B, K), bool)
                flags[0, 1] = t % 2 == 0
                human = actions + 500.0
                tr = step_out.transition.replace(intervene_actions=human, intervene_flags=flags)
                step_out = type(step_out)(
                    tr, step_out.obs, final_obs=step_out.final_obs, action_obs=step_out.action_obs
                )
                part = env_part(plan, key, step_out, prev)
                part = complete_env_part(plan, collector.layout, part, step_out, value_fn, None)
                collector.add(part)
                seen = step_out.action_obs["state"]  # [B, K, 2]
                done = tr.terminations | tr.truncations
                mid_chunk_ends += int(done[:, :-1].sum())
                ran = np.ones((B, K), bool) if tr.valid_actions is None else tr.valid_actions
                assert (chunk_end == "cut") == (tr.valid_actions is not None)
                for b in range(B):
                    for k in range(K):
                        if not ran[b, k]:  # cut: nothing ran after the episode's end
                            continue
                        c, f = (int(v) for v in seen[b, k])
                        assert (c, f) not in executed
                        taken = np.where(flags[b, k], human[b, k], actions[b, k])
                        executed[(c, f)] = (taken, bool(flags[b, k]))
                obs, prev = step_out.obs, tr
    assert mid_chunk_ends > 0  # episodes end inside chunks too
    ended = collector.end()  # the recording ends: running episodes written as truncated
    writer.close()
    for env in envs:
        env.close()
    return executed, sum(len(eps) for _, eps in ended)


def read(root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = pa.concat_tables([pq.read_table(p) for p in sorted(root.glob("data/*/*.parquet"))])
    meta = pa.concat_tables(
        [pq.read_table(p) for p in sorted(root.glob("meta/episodes/*/*.parquet"))],
        promote_options="default",
    )
    return data.to_pydict(), meta.to_pydict(), json.loads((root / "meta/info.json").read_text())


@pytest.mark.parametrize(
    "mode,chunk_end", [("NEXT_STEP", "cut"), ("SAME_STEP", "cut"), ("NEXT_STEP", "continue")]
)
def test_every_frame_shows_what_the_robot_saw_and_did(tmp_path, mode, chunk_end):
    from gymnasium.vector import AutoresetMode

    from jaxtraj.lerobot import video

    root = tmp_path / "ds"
    executed, ended = record(root, getattr(AutoresetMode, mode), chunk_end)
    data, meta, info = read(root)
    # Ending the recording wrote every frame: one per action taken (a chunk cut at an end
    # records only the actions that ran).
    assert info["total_frames"] == len(data["index"]) == len(executed)
    every = RANKS * STEPS * T * K * B
    assert len(executed) == every if chunk_end == "continue" else len(executed) < every
    assert ended > 0
    state = np.asarray(data["observation.state"], np.float64)
    reward = np.asarray(data["next.reward"], np.float64).reshape(-1)
    episode = np.asarray(data["episode_index"])
    frame = np.asarray(data["frame_index"])
    flat = lambda name: np.asarray(data[name]).reshape(-1)  # noqa: E731
    done, truncated, success = flat("next.done"), flat("next.truncated"), flat("next.success")
    intervened = flat("intervention")
    # Each frame: the observation its action was taken from, the env's reward for it
    # (100 * code + frame: no gamma * V of a truncation in it), the executed action.
    np.testing.assert_array_equal(state[:, 1], frame)  # every episode starts at its frame 0
    np.testing.assert_array_equal(reward, 100 * state[:, 0] + state[:, 1])
    action = np.asarray(data["action"], np.float32)
    for i in range(len(frame)):
        taken, by_human = executed[(int(state[i, 0]), int(state[i, 1]))]
        np.testing.assert_array_equal(action[i], taken)
        assert intervened[i] == by_human  # the intervention flag of that frame
    assert intervened.any() and not intervened.all()
    # One code per episode; flags only on its last frame; success where it terminated.
    for ep, length, ok in zip(meta["episode_index"], meta["length"], meta["success"]):
        rows = np.flatnonzero(episode == ep)
        assert len(rows) == length and len(set(state[rows, 0])) == 1
        assert done[rows].tolist() == [False] * (length - 1) + [True]
        c = int(state[rows[0], 0])
        full = length == 3 + ((c // 100) % 10 + c % 100) % 4  # ended by the env, not the end
        assert success[rows[-1]] == (full and c % 2 == 0) == ok
        assert truncated[rows[-1]] == (not full or c % 2 == 1)
        assert not success[rows[:-1]].any() and not truncated[rows[:-1]].any()
    # The camera, within the codec's threshold: each frame is its (episode, frame) image.
    key = "observation.images.top"
    fps = info["fps"]
    for ep in meta["episode_index"]:
        rows = np.flatnonzero(episode == ep)
        chunk, file = meta[f"videos/{key}/chunk_index"][ep], meta[f"videos/{key}/file_index"][ep]
        path = root / info["video_path"].format(video_key=key, chunk_index=chunk, file_index=file)
        start = round(meta[f"videos/{key}/from_timestamp"][ep] * fps)
        got = video.decode(path)[start : start + len(rows)].astype(np.int16)
        want = np.array([pixel(int(state[i, 0]), int(state[i, 1])) for i in rows], np.int16)
        assert np.abs(got - want[:, None, None, None]).max() <= 3, ep


def test_lerobot_loads_the_recording_frame_by_frame(tmp_path, lerobot_dataset):
    """LeRobot 0.6.1's own loader (offline, pyav backend) reads the recording: every
    frame's state, action, reward, flags, success and camera image as recorded (skipped
    where LeRobot is not installed: docs/lerobot.md says how to run it)."""
    import warnings

    from gymnasium.vector import AutoresetMode

    root = tmp_path / "ds"
    executed, _ = record(root, AutoresetMode.NEXT_STEP)
    data, meta, info = read(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = lerobot_dataset.LeRobotDataset(
            "local/jaxtraj_recording", root=root, video_backend="pyav"
        )
        assert len(ds) == info["total_frames"] == len(executed)
        assert ds.num_episodes == info["total_episodes"]
        for i in range(len(ds)):
            item = ds[i]
            state = np.asarray(item["observation.state"], np.float64)
            c, f = int(round(state[0])), int(round(state[1]))
            assert int(item["frame_index"]) == f  # each episode from its own frame 0
            np.testing.assert_allclose(float(item["next.reward"]), 100 * c + f)
            taken, by_human = executed[(c, f)]
            np.testing.assert_allclose(np.asarray(item["action"]), taken, rtol=1e-6)
            assert bool(item["intervention"]) == by_human
            image = (np.asarray(item["observation.images.top"]) * 255).round()
            assert np.abs(image - pixel(c, f)).max() <= 3, (i, c, f)
            for flag in ("next.done", "next.truncated", "next.success"):
                assert bool(item[flag]) == bool(np.asarray(data[flag][i]).reshape(-1)[0]), flag
