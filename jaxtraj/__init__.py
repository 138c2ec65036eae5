"""jaxtraj: a JAX-native trajectory collector for embodied reinforcement learning.

Join the two halves of every action chunk by key, accumulate them in fixed-capacity
device buffers, and flush Actor-ready output: trajectories (:mod:`jaxtraj.rollout`),
advantage-ready micro-batches per Actor rank (:mod:`jaxtraj.pipeline`), or episodes
written as a LeRobot dataset (:mod:`jaxtraj.lerobot`).

Internal modules (``checks``, ``storage``, ``_forwarding``) may change without notice.
"""

from jaxtraj.advantages import (
    discounted_returns,
    gae,
    gae_from_next_values,
    group_advantages,
    normalize_advantages,
)
from jaxtraj.collector import TrajectoryCollector, stack_parts
from jaxtraj.episode_stats import EpisodeStats, RunningEpisodes
from jaxtraj.errors import CollectorError, ErrorCode, raise_if_error
from jaxtraj.joiner import add_env, add_env_uniform, add_envs, add_policies, add_policy
from jaxtraj.modes import pipeline, rollout
from jaxtraj.modes.pipeline import MicroBatches
from jaxtraj.plan import TrajectoryPlan
from jaxtraj.state import (
    CollectorState,
    init,
    materialize,
    slot_complete,
    source_complete,
)
from jaxtraj.targets import Targets, trajectory_targets
from jaxtraj.types import (
    EnvPart,
    EnvTransition,
    PolicyInput,
    PolicyOutput,
    PolicyPart,
    Trajectory,
    TrajectoryKey,
    TrajectorySource,
    TrajectoryStep,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    """``jaxtraj.lerobot`` loads on first use: it needs pyarrow (the ``lerobot`` extra),
    which collection, training and the other output modes do not."""
    if name == "lerobot":
        import importlib  # here, not at module level: no jaxtraj.importlib

        try:
            module = importlib.import_module("jaxtraj.lerobot")
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "pyarrow":
                raise
            raise ImportError(
                f"jaxtraj.lerobot needs the lerobot extra (pip install 'jaxtraj[lerobot]'): {e}"
            ) from e
        globals()["lerobot"] = module
        return module
    raise AttributeError(f"module 'jaxtraj' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names: ``__all__``, ``lerobot`` (loaded on first use) and ``__version__``;
    the internal modules (``jaxtraj.checks``, ...) are not listed."""
    return sorted({*__all__, "lerobot", "__version__"})


# jaxtraj.lerobot is left out: a star import must not need the lerobot extra.
__all__ = [
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
