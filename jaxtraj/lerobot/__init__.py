"""Writing LeRobot ``v3.0`` datasets with pyarrow alone, and lerobot mode's dataset features.

One file per concern:

- :mod:`~jaxtraj.lerobot.format`: the folder layout, ``info.json`` and the declared features.
- :mod:`~jaxtraj.lerobot.validate`: checking the episodes handed to the writer.
- :mod:`~jaxtraj.lerobot.video`: camera frames to mp4 with PyAV (LeRobot's encoder settings).
- :mod:`~jaxtraj.lerobot.images`: camera frames as PNG in the data files.
- :mod:`~jaxtraj.lerobot.stats`: the running statistics behind ``meta/stats.json``.
- :mod:`~jaxtraj.lerobot.files`: files staged under hidden names, then renamed into place.
- :mod:`~jaxtraj.lerobot.resume`: opening an existing dataset, checking it, dropping its
  uncommitted tail.
- :mod:`~jaxtraj.lerobot.writer`: ``LeRobotWriter``, which appends episodes (in the background,
  with encoder threads, when there are cameras).

``features`` (from :mod:`jaxtraj.modes.lerobot`) gives the dataset features of a collector
plan's frames, to declare to ``LeRobotWriter``.
"""

from typing import Any

from jaxtraj.lerobot.format import CODEBASE_VERSION, DEFAULT_FEATURES
from jaxtraj.lerobot.stats import QUANTILES
from jaxtraj.lerobot.video import VideoSettings
from jaxtraj.lerobot.writer import LeRobotWriteError, LeRobotWriter

__all__ = [
    "CODEBASE_VERSION",
    "DEFAULT_FEATURES",
    "QUANTILES",
    "LeRobotWriteError",
    "LeRobotWriter",
    "VideoSettings",
    "features",
]


def __getattr__(name: str) -> Any:
    # ``features`` is imported on first use: the writer needs numpy and pyarrow (and PyAV and
    # Pillow for cameras, imported when used) only, and
    # jaxtraj.modes.lerobot (jax, the joiner) need not load, or be loaded, before it.
    if name == "features":
        from jaxtraj.modes.lerobot import features

        return features
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
