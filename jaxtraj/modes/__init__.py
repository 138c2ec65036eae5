"""Output modes: what happens when a completion scope is complete.

Every mode is a small frozen object with one common form, so the facade
(:class:`jaxtraj.TrajectoryCollector`) holds one and never asks which it is. The pure
functions trace (``jit``, ``vmap``); the host functions serve the facade.

Pure (state-passing; ``scope`` and the state's data may be traced)::

    init(state) -> mode_state
    ready(state, mode_state) -> bool[num_scopes]
    flush(state, mode_state, scope, current_version=0) -> (items, state, mode_state)

``flush`` returns its output first (a donated state's buffers go to the first outputs
that can take them), leaves the state's data untouched and records
``INCOMPLETE_SCOPE`` when the scope is not complete.

Host (the facade; ``mirror`` is its numpy record of what arrived, see
:class:`jaxtraj.collector.Mirror`)::

    stacked                              one stacked state (True) or one per source
    scopes(mirror) -> [scope]            complete scopes, in flush order
    state_index(scope) -> int            which of the facade's states holds it
    describe(scope, mirror) -> key       the key an error about it names
    compiled_flush(state, mode_state, scope, current_version) -> (items, state, mode_state)
    emit(items, scope, mirror) -> [(queue_key, item)]   may raise before anything changes
    advance(scope, mirror) -> [state index]  mark it flushed; the states whose step ended

The three modes:

| mode | scope | items |
| --- | --- | --- |
| :class:`Rollout` | one source's training step | a ``Trajectory`` |
| :class:`Pipeline` | one epoch of the step, across every source | ``MicroBatches`` per Actor rank |
| :class:`LeRobot` | one source's training step | the episodes that ended |
"""

from __future__ import annotations

from typing import Any

from jaxtraj.modes.lerobot import LeRobot
from jaxtraj.modes.pipeline import Pipeline
from jaxtraj.modes.rollout import Rollout
from jaxtraj.plan import TrajectoryPlan

_MODES = {"rollout": Rollout, "pipeline": Pipeline, "lerobot": LeRobot}


def for_plan(plan: TrajectoryPlan, **options: Any):
    """The output mode ``plan.mode`` names, built with its own ``options`` (e.g.
    ``rng`` and ``mesh`` for pipeline mode, ``writer`` and ``tasks`` for lerobot mode).

    Raises:
      TypeError: an option the mode does not take.
    """
    cls = _MODES[plan.mode]
    try:
        return cls(plan, **options)
    except TypeError as e:
        raise TypeError(f"{plan.mode} mode: {e}") from None


__all__ = ["LeRobot", "Pipeline", "Rollout", "for_plan"]
