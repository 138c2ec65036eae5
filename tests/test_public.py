"""The public surface: the names ``jaxtraj.__all__`` exports, and those the README and the
examples use from each mode and runner, pinned."""

from __future__ import annotations

import jaxtraj

PUBLIC = [
    "CollectorError",
    "CollectorState",
    "EnvPart",
    "EnvTransition",
    "EpisodeStats",
    "ErrorCode",
    "MicroBatches",
    "PolicyInput",
    "PolicyOutput",
    "PolicyPart",
    "RunningEpisodes",
    "Targets",
    "Trajectory",
    "TrajectoryCollector",
    "TrajectoryKey",
    "TrajectoryPlan",
    "TrajectorySource",
    "TrajectoryStep",
    "add_env",
    "add_env_uniform",
    "add_envs",
    "add_policies",
    "add_policy",
    "discounted_returns",
    "gae",
    "gae_from_next_values",
    "group_advantages",
    "init",
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
    # dir() lists the public names only: no internal module, no importlib
    assert dir(jaxtraj) == sorted([*PUBLIC, "lerobot", "__version__"])
    assert not hasattr(jaxtraj, "importlib")
    # jaxtraj.lerobot loads on first use (it needs the lerobot extra): not star-imported
    assert jaxtraj.lerobot.LeRobotWriter is not None


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


def test_the_core_imports_without_the_lerobot_extra(tmp_path):
    """``import jaxtraj`` and a collection need no pyarrow (the README's main command
    installs only the examples extra); ``jaxtraj.lerobot`` says which extra it needs."""
    import subprocess
    import sys
    import textwrap

    hide = tmp_path / "sitecustomize.py"  # makes pyarrow unimportable in the child
    hide.write_text(textwrap.dedent("""
        import sys
        class _Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "pyarrow" or name.startswith("pyarrow."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, _Hide())
    """))
    code = textwrap.dedent("""
        import numpy as np
        import jaxtraj
        from jaxtraj import *  # noqa: F403
        assert "pyarrow" not in __import__("sys").modules
        plan = jaxtraj.TrajectoryPlan(num_chunks=1, batch_size=2)
        key = jaxtraj.TrajectoryKey(0, 0, 0, 0, 0)
        src = jaxtraj.TrajectorySource(key, 2, 0)
        out = jaxtraj.PolicyOutput(actions=np.zeros((2, 1), np.float32))
        pol = jaxtraj.PolicyPart(src, {"x": np.zeros((2, 3), np.float32)}, out)
        z = np.zeros((2,), bool)
        tr = jaxtraj.EnvTransition(rewards=np.ones((2,), np.float32), terminations=z,
                                   truncations=z)
        env = jaxtraj.EnvPart(src, tr, initial_transition=tr.boundary())
        c = jaxtraj.TrajectoryCollector(plan, pol, env)
        assert c.add(pol) == [] and len(c.add(env)) == 1
        try:
            jaxtraj.lerobot
        except ImportError as e:
            assert "jaxtraj[lerobot]" in str(e), e
        else:
            raise AssertionError("jaxtraj.lerobot imported without pyarrow")
        print("ok")
    """)
    import os

    paths = [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
