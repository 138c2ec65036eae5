"""Lerobot mode: episodes on device, carried across training steps, split at dones."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import PLAN, B, E, K, T, action_obs, all_parts, env_part, policy_part

import jaxtraj
from jaxtraj import CollectorError, ErrorCode

LR = dataclasses.replace(PLAN, mode="lerobot", num_env_ranks=1, max_episode_length=16)


class ListWriter:
    """Records what a dataset writer receives."""

    def __init__(self):
        self.episodes, self.tasks = [], []

    def add_episodes(self, episodes, tasks):
        self.episodes += episodes
        self.tasks += tasks


def expected_episodes(steps, per_action=True):
    """NumPy reference: per env, the frames of every completed episode, in order: ``(action,
    reward, done, state, image)``, the observation each action was taken from."""
    out = {b: [] for b in range(B)}
    for b in range(B):
        current = []
        for step in range(steps):
            for e in range(E):
                for t in range(T):
                    p, v = policy_part(t, e, step=step), env_part(t, e, step=step)
                    per_obs = action_obs(t, e, step=step)
                    done = bool(v.transition.terminations[b])
                    for j in range(K if per_action else 1):
                        obs = (
                            (per_obs["state"][b, j], per_obs["image"][b, j])
                            if per_action
                            else (p.obs["state"][b], p.obs["image"][b])
                        )
                        action = (
                            p.output.actions[b, j]
                            if per_action
                            else p.output.actions[b].reshape(-1)
                        )
                        reward = (
                            v.transition.rewards[b, j]
                            if per_action
                            else v.transition.rewards[b].sum()
                        )
                        end = done and (j == K - 1 or not per_action)
                        current.append((action, reward, end, *obs))
                        if end:
                            out[b].append(current)
                            current = []
    return out


def run(plan, steps, writer=None):
    example = env_part(0, per_action=True)
    c = jaxtraj.TrajectoryCollector(plan, policy_part(0), example, writer=writer, tasks="pick")
    items = []
    for step in range(steps):
        for p in all_parts(step=step, per_action=True):
            items += c.add(p)
    return c, items


@pytest.mark.parametrize("frame", ["action", "chunk"])
def test_episodes_match_reference_across_steps(frame):
    plan = dataclasses.replace(LR, lerobot_frame=frame)
    writer = ListWriter()
    c, items = run(plan, steps=2, writer=writer)
    assert len(items) == 2 and all(k == "default" for k, _ in items)
    want = expected_episodes(2, per_action=frame == "action")
    got = {b: [] for b in range(B)}
    for _, episodes in items:
        for b, frames in episodes:
            got[b].append(frames)
    for b in range(B):
        assert len(got[b]) == len(want[b]), b
        for g, w in zip(got[b], want[b]):
            np.testing.assert_allclose(g["action"], np.stack([f[0] for f in w]))
            np.testing.assert_allclose(g["next.reward"][:, 0], [f[1] for f in w], rtol=1e-6)
            assert g["next.done"][:, 0].tolist() == [f[2] for f in w]
            # Each frame shows the observation its action was taken from.
            np.testing.assert_array_equal(g["observation.state"], np.stack([f[3] for f in w]))
            np.testing.assert_array_equal(
                g["observation.images.image"], np.stack([f[4] for f in w])
            )
    # Every episode handed to the writer, with its task.
    assert len(writer.episodes) == sum(len(v) for v in want.values())
    assert set(writer.tasks) == {"pick"}
    # Episodes still running stay on device and continue in the next step.
    frames_per_step = E * T * (K if frame == "action" else 1)
    running = np.asarray(c.mode_states[0].length)
    for b in range(B):
        total = 2 * frames_per_step
        assert running[b] == total - sum(len(ep) for ep in want[b])


def test_an_episode_crosses_the_step_boundary():
    _, items = run(LR, steps=2)
    # env 2 ends episodes at chunk 2 (the last), so none crosses; env 1 ends at chunk 1:
    # its episode after the last done of step 0 ends in step 1.
    step1 = [frames for b, frames in items[1][1] if b == 1]
    first = step1[0]
    step0_tail = K * 1  # chunk 2 of the last epoch of step 0: K frames
    assert len(first["action"]) == step0_tail + K * 2  # + chunks 0 and 1 of step 1's first epoch
    np.testing.assert_allclose(
        first["action"][0], policy_part(2, E - 1, step=0).output.actions[1, 0]
    )


def test_overflow_is_an_error_or_a_truncation():
    short = dataclasses.replace(LR, max_episode_length=3)
    c = jaxtraj.TrajectoryCollector(short, policy_part(0), env_part(0, per_action=True))
    parts = all_parts(per_action=True)
    for p in parts[:-1]:
        assert c.add(p) == []
    before = np.asarray(c.mode_states[0].length).copy()
    with pytest.raises(CollectorError) as info:
        c.add(parts[-1])
    assert info.value.code == ErrorCode.EPISODE_OVERFLOW
    np.testing.assert_array_equal(np.asarray(c.mode_states[0].length), before)  # nothing changed
    # end() says the step waits for a flush because its auto-flush failed (it had blamed
    # auto_flush=False, which the collector does not have; from a newcomer's trial).
    with pytest.raises(CollectorError, match=r"complete but not flushed \(their auto-flush "
                       r"failed: the error it raised says why\)"):
        c.end()

    cut = dataclasses.replace(short, episode_overflow="truncate")
    _, items = run(cut, steps=1)
    for _, frames in items[0][1]:
        assert len(frames["action"]) <= 3
        assert frames["next.done"][-1, 0]
    assert any(f["next.truncated"][-1, 0] for _, f in items[0][1])


def test_interventions_travel_with_their_frames():
    from test_interventions import collect as collect_intervened

    def flags_of(e, t):
        f = np.zeros((B, K), bool)
        if (e, t) == (0, 1):
            f[2, 1] = True  # env 2, the second action of chunk 1
        return f

    traj = collect_intervened(flags_of)
    frames, _, _ = jaxtraj.types.trajectory_frames(traj, per_action=True, actions_per_chunk=K)
    flags = np.asarray(frames["intervention"])[..., 0]  # [n, B], n = E*T*K, time-ordered
    expect = np.zeros_like(flags)
    expect[(0 * T + 1) * K + 1, 2] = True
    np.testing.assert_array_equal(flags, expect)
    np.testing.assert_array_equal(
        frames["action"][(0 * T + 1) * K + 1, 2], 99.0
    )  # the human action
    per_chunk, _, _ = jaxtraj.types.trajectory_frames(traj, per_action=False, actions_per_chunk=K)
    assert (
        np.asarray(per_chunk["intervention"])[0 * T + 1, 2, 0]
        and int(np.asarray(per_chunk["intervention"]).sum()) == 1
    )


# -- defect 2: K comes from the action chunk, not from the rewards --------------------------

K3, A2 = 3, 2  # actions [B, 3, 2] with chunk-level rewards [B]
SHORT = dataclasses.replace(LR, num_chunks=2, num_epochs=1)


def _chunk_level(t):
    """Chunk ``t`` of 2 with actions [B, 3, 2] and rewards [B]; every env ends at chunk 1."""
    p = policy_part(t)
    actions = np.arange(B * K3 * A2, dtype=np.float32).reshape(B, K3, A2) + 100 * t
    p = p.replace(output=p.output.replace(actions=actions, prev_logprobs=-actions))
    v = env_part(t, done_at=np.full((B,), t == 1))
    rewards = (10 * t + np.arange(B)).astype(np.float32)
    k = np.arange(K3, dtype=np.float32)[None, :, None] / 100
    per_obs = {  # the observation each of the K3 actions was taken from
        "image": np.repeat(p.obs["image"][:, None], K3, axis=1),
        "state": p.obs["state"][:, None] + k,
    }
    return p, v.replace(transition=v.transition.replace(rewards=rewards), action_obs=per_obs)


def test_per_action_frames_take_k_from_the_action_chunk():
    writer = ListWriter()
    p0, v0 = _chunk_level(0)
    c = jaxtraj.TrajectoryCollector(SHORT, p0, v0, writer=writer, tasks="pick")
    items = []
    for t in range(2):
        for part in _chunk_level(t):
            items += c.add(part)
    ((_, episodes),) = items
    assert sorted(b for b, _ in episodes) == list(range(B))
    for b, frames in episodes:
        assert frames["action"].shape == (2 * K3, A2)  # six frames of width 2, not 2 of 6
        want = np.concatenate([_chunk_level(t)[0].output.actions[b] for t in range(2)])
        np.testing.assert_array_equal(frames["action"], want)
        # A chunk-level reward belongs to the chunk's last action.
        reward = np.zeros((2 * K3,), np.float32)
        reward[[K3 - 1, 2 * K3 - 1]] = [b, 10 + b]
        np.testing.assert_array_equal(frames["next.reward"][:, 0], reward)
        assert frames["next.done"][:, 0].tolist() == [False] * (2 * K3 - 1) + [True]
    assert len(writer.episodes) == B
    assert jaxtraj.lerobot.features(SHORT, p0, v0)["action"]["shape"] == [A2]


def test_action_level_rewards_of_another_k_are_rejected():
    p0, v0 = _chunk_level(0)
    wrong = v0.replace(transition=v0.transition.replace(rewards=np.zeros((B, K3 - 1), np.float32)))
    with pytest.raises(CollectorError, match="rewards") as info:
        jaxtraj.TrajectoryCollector(SHORT, p0, wrong)
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH
    # Against a plan whose examples agree, the same part is rejected on arrival.
    c = jaxtraj.TrajectoryCollector(SHORT, p0, v0)
    with pytest.raises(CollectorError, match="rewards") as info:
        c.add(wrong)
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH


# -- cameras: [H, W, 3] uint8 observations travel with the frames ----------------------------


def test_camera_frames_travel_with_their_episodes():
    writer = ListWriter()
    _, items = run(LR, steps=2, writer=writer)
    want = expected_episodes(2)
    got = {b: [f for _, eps in items for bb, f in eps if bb == b] for b in range(B)}
    for b in range(B):
        assert len(got[b]) == len(want[b])
        for frames, ref in zip(got[b], want[b]):
            images = frames["observation.images.image"]
            assert images.shape == (len(ref), 2, 2, 3) and images.dtype == np.uint8
            # helpers' image is (chunk tag + action) mod 251, per action.
            np.testing.assert_array_equal(images, np.stack([f[4] for f in ref]))
    assert all("observation.images.image" in e for e in writer.episodes)


def test_camera_features_and_non_rgb_images():
    p, v = policy_part(0), env_part(0, per_action=True)
    features = jaxtraj.lerobot.features(LR, p, v)
    assert features["observation.images.image"] == {
        "dtype": "video",
        "shape": [2, 2, 3],
        "names": ["height", "width", "channels"],
    }
    assert features["observation.state"]["shape"] == [5]
    kinds = {"observation.images.image": "image"}
    assert (
        jaxtraj.lerobot.features(LR, p, v, cameras=kinds)["observation.images.image"]["dtype"]
        == "image"
    )
    with pytest.raises(ValueError, match="kind must be"):
        jaxtraj.lerobot.features(LR, p, v, cameras="mp4")
    depth = p.replace(obs={**p.obs, "image": np.zeros((B, 2, 2, 1), np.uint8)})
    with pytest.raises(ValueError, match="uint8 with C = 3"):
        jaxtraj.lerobot.features(LR, depth, v)


def test_dataset_rewards_are_the_environments_never_the_truncation_bootstrap():
    """gamma 0.5, V(final obs) = 10 at a truncation: the trajectory's training reward is
    r + 5, the dataset's is r (what the environment gave)."""
    plan = dataclasses.replace(SHORT, gamma=0.5)
    parts = []
    for t in range(2):
        p, v = _chunk_level(t)
        tr = v.transition.replace(truncations=np.full((B,), t == 0))  # every env cut at chunk 0
        parts += [p, v.replace(transition=tr, final_values=np.full((B,), 10.0, np.float32))]
    writer = ListWriter()
    c = jaxtraj.TrajectoryCollector(plan, *parts[:2], writer=writer, tasks="pick")
    for part in parts:
        c.add(part)
    assert len(writer.episodes) == 2 * B  # each env: the truncated episode, the terminated one
    rollout_plan = dataclasses.replace(plan, mode="rollout")
    rollout = jaxtraj.TrajectoryCollector(rollout_plan, *parts[:2])
    ((_, traj),) = [item for part in parts for item in rollout.add(part)]
    np.testing.assert_allclose(np.asarray(traj.rewards)[0, 0], np.arange(B))  # as given
    targets = jaxtraj.trajectory_targets(rollout_plan, traj)
    np.testing.assert_allclose(np.asarray(targets.rewards)[0, 0], np.arange(B) + 5.0)  # training
    by_env = {}
    for frames, task in zip(writer.episodes, writer.tasks):
        assert task == "pick"
        by_env.setdefault(int(frames["action"][0, 0]) % 100 // (K3 * A2), []).append(frames)
    for b, (first, second) in by_env.items():
        np.testing.assert_array_equal(first["next.reward"][:, 0], [0.0, 0.0, b])
        assert first["next.truncated"][:, 0].tolist() == [False, False, True]
        np.testing.assert_array_equal(second["next.reward"][:, 0], [0.0, 0.0, 10.0 + b])


def test_expert_halves_are_recorded_in_lerobot_mode_and_refused_elsewhere():
    """A policy half that was not inferred (a teleoperator's, a scripted expert's: actions
    only) is welcome in lerobot mode, zero-filled; rollout and pipeline modes train on
    log-probabilities and values, so they refuse it, naming the mode and the fields."""
    import jax

    def expert(p):
        return p.replace(output=jaxtraj.PolicyOutput(actions=p.output.actions))

    writer = ListWriter()
    example = env_part(0, per_action=True)
    c = jaxtraj.TrajectoryCollector(LR, policy_part(0), example, writer=writer, tasks="pick")
    items = []
    for step in range(2):
        for p in all_parts(step=step, per_action=True):
            items += c.add(expert(p) if isinstance(p, jaxtraj.PolicyPart) else p)
    want = expected_episodes(2)
    got = {b: [f for _, eps in items for bb, f in eps if bb == b] for b in range(B)}
    for b in range(B):
        assert len(got[b]) == len(want[b]) > 0
        for g, w in zip(got[b], want[b]):
            np.testing.assert_allclose(g["action"], np.stack([f[0] for f in w]))
    for mode in ("rollout", "pipeline"):
        plan = dataclasses.replace(PLAN, mode=mode)
        c = jaxtraj.TrajectoryCollector(plan, policy_part(0), env_part(0))
        with pytest.raises(CollectorError, match=f"lerobot mode only; {mode} mode") as info:
            c.add(expert(policy_part(1)))
        assert info.value.code == ErrorCode.STRUCTURE_MISMATCH
        assert "prev_logprobs" in str(info.value) and "prev_values" in str(info.value)
        assert c.missing()  # nothing changed; the step still waits for every half
    # The pure functions, under jit: the same rule at trace time.
    state = jaxtraj.init(LR, policy_part(0), example)
    state = jax.jit(lambda st, p: jaxtraj.add_policy(LR, st, p))(state, expert(policy_part(1)))
    jaxtraj.raise_if_error(state)
    assert np.asarray(state.policy_rows)[0, 1].all()
    np.testing.assert_array_equal(np.asarray(state.policy.output.prev_logprobs)[0, 1], 0.0)
    rollout = dataclasses.replace(PLAN, mode="rollout")
    with pytest.raises(CollectorError, match="rollout mode"):
        jaxtraj.add_policy(rollout, jaxtraj.init(rollout, policy_part(0), env_part(0)),
                           expert(policy_part(1)))


def test_end_writes_every_running_episode_and_close_without_it_says_what_is_left(
    tmp_path, caplog
):
    import logging

    from jaxtraj.lerobot import LeRobotWriter

    example = env_part(0, per_action=True)
    features = jaxtraj.lerobot.features(LR, policy_part(0), example, cameras="image")
    steps = 2

    def collect(root):
        writer = LeRobotWriter(root, fps=10, features=features)
        c = jaxtraj.TrajectoryCollector(LR, policy_part(0), example, writer=writer, tasks="pick")
        for step in range(steps):
            for p in all_parts(step=step, per_action=True):
                c.add(p)
        return c, writer

    c, writer = collect(tmp_path / "ended")
    assert writer.running_frames == int(np.asarray(c.mode_states[0].length).sum()) > 0
    ended = c.end()
    assert writer.running_frames == 0 and c.end() == []  # nothing runs after it
    ((_, episodes),) = ended
    assert {b for b, _ in episodes} == {b for b in range(B) if b % T != T - 1}
    for _, frames in episodes:  # the recording ended them: done and truncated, last only
        assert frames["next.done"][:, 0].tolist() == [False] * (len(frames["action"]) - 1) + [True]
        assert frames["next.truncated"][-1, 0]
    with caplog.at_level(logging.WARNING, logger="jaxtraj.lerobot.writer"):
        writer.close()
    assert not caplog.records
    # Every frame collected is written: one per action of every env.
    assert writer.num_frames == steps * E * T * K * B

    c, writer = collect(tmp_path / "not_ended")
    left = writer.running_frames
    with caplog.at_level(logging.WARNING, logger="jaxtraj.lerobot.writer"):
        writer.close()
    (record,) = caplog.records
    assert f"{left} frames of running episodes not written" in record.getMessage()
    assert "TrajectoryCollector.end()" in record.getMessage()
    assert writer.num_frames == steps * E * T * K * B - left


def test_end_refuses_while_a_step_is_half_collected():
    writer = ListWriter()
    c = jaxtraj.TrajectoryCollector(
        LR, policy_part(0), env_part(0, per_action=True), writer=writer, tasks="pick"
    )
    for p in all_parts(step=0, per_action=True) + all_parts(step=1, per_action=True)[:3]:
        c.add(p)
    written = len(writer.episodes)
    with pytest.raises(CollectorError, match="half collected") as info:
        c.end()
    assert info.value.code == ErrorCode.INCOMPLETE_SCOPE
    assert len(writer.episodes) == written  # nothing written, nothing lost
    for p in all_parts(step=1, per_action=True)[3:]:
        c.add(p)
    assert c.end()  # the step complete: the running episodes are written
    assert len(writer.episodes) > written


def test_per_action_observations_of_the_wrong_k_shape_or_dtype_name_the_field():
    c = jaxtraj.TrajectoryCollector(LR, policy_part(0), env_part(0, per_action=True))
    good = env_part(1, per_action=True)
    obs = good.action_obs
    bad = {
        "K": {**obs, "state": obs["state"][:, :1]},  # one action's observation, K = 2
        "shape": {**obs, "state": obs["state"][..., :4]},
        "dtype": {**obs, "image": obs["image"].astype(np.float32)},
        "missing": None,  # the plan's example carries them: every half must
    }
    field = {"K": "action_obs['state']", "shape": "action_obs['state']",
             "dtype": "action_obs['image']", "missing": "action_obs"}
    for what, value in bad.items():
        with pytest.raises(CollectorError, match=field[what].replace("[", r"\[")) as info:
            c.add(good.replace(action_obs=value))
        assert info.value.code == ErrorCode.STRUCTURE_MISMATCH, what
    assert c.add(good) == []  # nothing changed: the right half still goes in


def test_a_stacked_expert_half_and_end_and_restore_bookkeeping():
    """A stack of expert halves through add_many is zero-filled like one (found by review);
    end() with complete but unflushed scopes (auto_flush=False) says to flush them; a
    collector restored from a state_dict tells its writer how many running frames it has."""
    import jax

    expert = lambda p: p.replace(output=jaxtraj.PolicyOutput(actions=p.output.actions))  # noqa: E731
    example = env_part(0, per_action=True)
    c = jaxtraj.TrajectoryCollector(LR, policy_part(0), example)
    policies = [expert(p) for p in all_parts(per_action=True) if isinstance(p, jaxtraj.PolicyPart)]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *policies)
    assert c.add_many(stacked) == []
    assert not [k for k, half, _ in c.missing() if half == "policy"]  # every policy half in

    c = jaxtraj.TrajectoryCollector(LR, policy_part(0), example, auto_flush=False)
    for p in all_parts(per_action=True):
        c.add(p)
    with pytest.raises(CollectorError, match=r"complete but not flushed.*flush\(\)"):
        c.end()
    c.flush()
    assert c.end()

    class Counting(ListWriter):
        running_frames = 0

    source = jaxtraj.TrajectoryCollector(LR, policy_part(0), example)
    for p in all_parts(per_action=True):
        source.add(p)
    running = int(np.asarray(source.mode_states[0].length).sum())
    writer = Counting()
    restored = jaxtraj.TrajectoryCollector(LR, policy_part(0), example, writer=writer)
    restored.load_state_dict(source.state_dict())
    assert writer.running_frames == running > 0
