"""Human interventions: element-wise replacement, flags, forward inputs, segments, bad shapes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import PLAN, A, B, K, T, all_parts, env_part, policy_part

import jaxtraj
from jaxtraj import CollectorError, ErrorCode

HUMAN = 99.0


def intervened(part, flags):
    """An env half where the human executed the actions marked in ``flags [B, K]``."""
    tr = part.transition.replace(
        intervene_actions=np.full((B, K * A), HUMAN, np.float32), intervene_flags=flags
    )
    return part.replace(transition=tr)


def with_action_input(part):
    """A policy half that retains its actions as a forward input, as VLA models do."""
    out = part.output
    return part.replace(
        output=out.replace(
            forward_inputs={**out.forward_inputs, "action": out.actions.reshape(B, -1)}
        )
    )


def collect(flags_of):
    example_env = intervened(env_part(0), np.zeros((B, K), bool))
    c = jaxtraj.TrajectoryCollector(PLAN, with_action_input(policy_part(0)), example_env)
    out = []
    for p in all_parts(0):
        if isinstance(p, jaxtraj.EnvPart):
            k = p.source.key
            p = intervened(p, flags_of(int(k.epoch_id), int(k.chunk_id)))
        else:
            p = with_action_input(p)
        out += c.add(p)
    return out[0][1]


def test_element_wise_replacement_flags_and_forward_inputs():
    flags = np.zeros((B, K), bool)
    flags[1, 0] = flags[2, 1] = True
    traj = collect(lambda e, t: flags if (e, t) == (0, 1) else np.zeros((B, K), bool))
    expect = np.array(policy_part(1).output.actions)
    expect[1, 0] = HUMAN  # action 0 of env 1, every dimension
    expect[2, 1] = HUMAN
    np.testing.assert_array_equal(traj.actions[0, 1], expect)
    np.testing.assert_array_equal(traj.actions[0, 0], policy_part(0).output.actions)
    assert traj.intervene_flags.shape == traj.actions.shape
    assert int(traj.intervene_flags.sum()) == 2 * A
    # The forward pass scores what was executed.
    np.testing.assert_array_equal(traj.forward_inputs["action"][0, 1], expect.reshape(B, -1))


def test_intervened_segments():
    def flags_of(e, t):
        f = np.zeros((B, K), bool)
        if e == 0 and t in (0, 1):
            f[0, :] = True  # env 0: all actions of chunks 0 and 1
        if e == 1 and t == 2:
            f[3, 0] = True  # env 3: one action of chunk 2
        return f

    traj = collect(flags_of)
    assert traj.intervened_segments("any") == [(0, 0, 0, 2), (1, 3, 2, 3)]
    assert traj.intervened_segments("all") == [(0, 0, 0, 2)]
    with pytest.raises(ValueError, match="mode"):
        traj.intervened_segments("some")


@pytest.mark.parametrize(
    "actions,flags,match",
    [
        (np.zeros((B, K * A + 1), np.float32), np.zeros((B, K), bool), "intervene_actions"),
        (np.zeros((B, K * A), np.float32), np.zeros((B, K), np.int32), "intervene_flags"),
        (np.zeros((B, K * A), np.float32), np.zeros((B, K + 1), bool), "intervene_flags"),
    ],
)
def test_bad_intervention_shapes_are_rejected(actions, flags, match):
    example_env = intervened(env_part(0), np.zeros((B, K), bool))
    c = jaxtraj.TrajectoryCollector(PLAN, policy_part(0), example_env)
    c.add(policy_part(1))
    bad = env_part(1).replace(
        transition=env_part(1).transition.replace(intervene_actions=actions, intervene_flags=flags)
    )
    with pytest.raises(CollectorError, match=match) as info:
        c.add(bad)
    assert info.value.code == ErrorCode.STRUCTURE_MISMATCH
    assert info.value.key == (0, 0, 0, 0, 1)


def test_model_side_flags_are_recorded_never_replace_actions():
    """``PolicyOutput.intervene_flags`` (the policy side corrected the action itself): or-ed
    into the flags beside the env's, per action element; actions and the forward input
    ``"action"`` change only where the env's human actions say."""
    model = np.zeros((B, K), bool)
    model[0, 1] = model[1, 0] = True  # env 1 action 0: also the human's below
    env = np.zeros((B, K), bool)
    env[1, 0] = env[2, 1] = True

    def with_model_flags(p):
        return p.replace(output=p.output.replace(intervene_flags=model))

    example_env = intervened(env_part(0), np.zeros((B, K), bool))
    c = jaxtraj.TrajectoryCollector(PLAN, with_model_flags(with_action_input(policy_part(0))),
                                    example_env)
    out = []
    for p in all_parts(0):
        if isinstance(p, jaxtraj.EnvPart):
            p = intervened(p, env if p.source.key.as_tuple()[1:] == (0, 0, 0, 1) else np.zeros_like(env))
        else:
            p = with_model_flags(with_action_input(p))
        out += c.add(p)
    traj = out[0][1]
    expect = np.array(policy_part(1).output.actions)
    expect[1, 0] = expect[2, 1] = HUMAN  # the env's; the model's [0, 1] is the policy's own
    np.testing.assert_array_equal(traj.actions[0, 1], expect)
    np.testing.assert_array_equal(traj.forward_inputs["action"][0, 1], expect.reshape(B, -1))
    flags = np.asarray(traj.intervene_flags)  # [E, T, B, K, A]
    np.testing.assert_array_equal(flags[0, 1], np.repeat((model | env)[..., None], A, -1))
    np.testing.assert_array_equal(flags[0, 0], np.repeat(model[..., None], A, -1))
    assert traj.intervened_segments("any")[0] == (0, 0, 0, T)  # env 0: every chunk (model)
