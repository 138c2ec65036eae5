"""How an output mode lays its sources out over the facade's states (internal).

A mode whose scope is one source keeps one single-source state per source (a flush
hands that state's buffers over whole); a mode whose scope spans sources keeps one
stacked state. The facade asks these questions instead of which mode it holds.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class PerSource:
    """One single-source state per source: state ``s`` holds source ``s``."""

    @staticmethod
    def groups(num_sources: int) -> list[list[int]]:
        """The source indices each state holds."""
        return [[s] for s in range(num_sources)]

    @staticmethod
    def state_sources(group: list[int], sources: list) -> Any:
        return sources[group[0]]

    @staticmethod
    def slot(s: Any, e: Any, t: Any, off: Any) -> tuple[int, tuple]:
        """The state holding source ``s`` and where a slot starts in it (``s`` may be an
        array of one source, repeated)."""
        return (s if isinstance(s, int) else int(np.asarray(s).reshape(-1)[0])), (e, t, off)

    @staticmethod
    def split(owners: np.ndarray) -> list[Any]:
        """Row selections of a stack of parts, one per state they go to."""
        return [owners == s for s in np.unique(owners)]

    @staticmethod
    def join(states: list) -> Any:
        """Every state as one stacked host copy."""
        return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states)


class Stacked:
    """One stacked state: every source on a leading axis."""

    @staticmethod
    def groups(num_sources: int) -> list[list[int]]:
        return [list(range(num_sources))]

    @staticmethod
    def state_sources(group: list[int], sources: list) -> Any:
        return [sources[s] for s in group]

    @staticmethod
    def slot(s: Any, e: Any, t: Any, off: Any) -> tuple[int, tuple]:
        return 0, (s, e, t, off)

    @staticmethod
    def split(owners: np.ndarray) -> list[Any]:
        return [slice(None)]

    @staticmethod
    def join(states: list) -> Any:
        return jax.tree.map(np.asarray, states[0])
