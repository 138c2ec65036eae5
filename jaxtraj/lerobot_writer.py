"""Compatibility module: the LeRobot writer now lives in :mod:`jaxtraj.lerobot`.

``from jaxtraj.lerobot_writer import LeRobotWriter, DEFAULT_FEATURES`` keeps working; new code
imports from ``jaxtraj.lerobot``. ``_to_numpy``, ``_tasks_table`` and ``_DICTIONARY_COLUMNS``
remain for ``benchmarks/lerobot.py``; their homes are ``jaxtraj.lerobot.format.to_numpy``,
``jaxtraj.lerobot.format.tasks_table`` and ``jaxtraj.lerobot.writer.DICTIONARY_COLUMNS``.
"""

from jaxtraj.lerobot.format import CODEBASE_VERSION, DEFAULT_FEATURES
from jaxtraj.lerobot.format import tasks_table as _tasks_table  # noqa: F401 (kept for callers)
from jaxtraj.lerobot.format import to_numpy as _to_numpy  # noqa: F401 (kept for callers)
from jaxtraj.lerobot.stats import QUANTILES
from jaxtraj.lerobot.writer import DICTIONARY_COLUMNS as _DICTIONARY_COLUMNS  # noqa: F401
from jaxtraj.lerobot.writer import LeRobotWriter

__all__ = ["CODEBASE_VERSION", "DEFAULT_FEATURES", "QUANTILES", "LeRobotWriter"]
