"""The public surface: the names ``jaxtraj.__all__`` exports, and those the README and the
examples use from each mode and runner, pinned."""

from __future__ import annotations

import jaxtraj

PUBLIC = [
    "CollectorError",
    "CollectorState",
    "EnvPart",
    "EnvTransition",
    "ErrorCode",
    "MicroBatches",
    "PolicyInput",
    "PolicyOutput",
    "PolicyPart",
    "Targets",
    "Trajectory",
    "TrajectoryCollector",
    "TrajectoryKey",
    "TrajectoryPlan",
    "TrajectorySource",
    "TrajectoryStep",
    "add_env",
    "add_envs",
    "add_policies",
    "add_policy",
    "discounted_returns",
    "gae",
    "gae_from_next_values",
    "group_advantages",
    "init",
    "lerobot",
    "materialize",
    "normalize_advantages",
    "pipeline",
    "raise_if_error",
    "rollout",
    "slot_complete",
    "source_complete",
    "stack_parts",
    "trajectory_targets",
]


def test_public_names():
    assert sorted(jaxtraj.__all__) == sorted(PUBLIC)
    for name in jaxtraj.__all__:
        assert getattr(jaxtraj, name) is not None


def test_names_the_readme_and_examples_use():
    for name in ("flush", "ready", "Rollout"):
        assert callable(getattr(jaxtraj.rollout, name))
    for name in ("flush", "init", "make_flush", "shard_state", "ready", "Pipeline"):
        assert callable(getattr(jaxtraj.pipeline, name))
    for name in ("LeRobotWriter", "features"):
        assert callable(getattr(jaxtraj.lerobot, name))
    from jaxtraj.runners import sync, threads

    for name in ("make_collect", "reset", "example_parts"):
        assert callable(getattr(sync, name))
    for name in ("AsyncRunner", "DecoupledRunner", "RunnerError"):
        assert callable(getattr(threads, name))
