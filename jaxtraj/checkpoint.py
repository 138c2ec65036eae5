"""Checkpoint and restore a ``TrajectoryCollector`` with orbax.

Everything the collector holds is saved: the device states (partial slots and routed
fragments included), the host mirror of what has arrived, the training steps, pipeline
mode's flushed epochs, key and policy version, and lerobot mode's running episodes. A
restore, in a fresh process too, continues exactly where the checkpoint was taken:
flushes are bit-identical.

A checkpoint is a folder: ``state/`` (orbax) and ``jaxtraj.json`` (the plan, the layout
and a CRC32 of every array), written last, so a checkpoint without it is incomplete.
Restoring under another plan or layout, or from a damaged folder, raises
:class:`CheckpointError` naming what differs; nothing is silently restored.

    jaxtraj.checkpoint.save(collector, "/ckpt/step_12")
    collector = jaxtraj.checkpoint.restore("/ckpt/step_12", plan, policy_example, env_example)
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

FORMAT = 1
META = "jaxtraj.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored: another plan or layout, or damaged."""


def _tree(collector) -> dict[str, Any]:
    """Everything a collector holds, as one pytree of arrays."""
    from jaxtraj.types import EnvPart, PolicyPart

    host = {
        "policy_rows": collector._rows[PolicyPart],
        "env_rows": collector._rows[EnvPart],
        "step": collector._step,
    }
    if collector._pipeline:
        host.update(
            flushed=collector._flushed,
            current_version=np.asarray(collector.current_version, np.int64),
            rng=np.asarray(jax.random.key_data(collector._rng))
            if jax.dtypes.issubdtype(collector._rng.dtype, jax.dtypes.prng_key)
            else np.asarray(collector._rng),
        )
    return {
        "states": list(collector._states),
        "episodes": list(getattr(collector, "_episodes", None) or []),
        "host": host,
    }


def _crc(leaves: list) -> list[int]:
    return [
        zlib.crc32(np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)) for x in leaves
    ]


def _dtype(x: Any) -> np.dtype:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _layout(tree: Any) -> list[list]:
    return [[list(np.shape(x)), str(_dtype(x))] for x in jax.tree.leaves(tree)]


def save(collector, path: str | os.PathLike[str]) -> None:
    """Write a checkpoint of ``collector`` to the new folder ``path``."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists():
        raise CheckpointError(f"{path} exists; checkpoints are written to a new folder")
    tree = _tree(collector)
    leaves = jax.tree.leaves(tree)
    with ocp.StandardCheckpointer() as checkpointer:  # leaving it waits for the write
        checkpointer.save(path / "state", tree)
    meta = {
        "format": FORMAT,
        "plan": repr(collector.plan),
        "sources": collector._sources.tolist(),
        "treedef": str(jax.tree.structure(tree)),
        "layout": _layout(tree),
        "crc32": _crc(leaves),
    }
    tmp = path / f".{META}.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, path / META)  # last: its presence marks a complete checkpoint


def restore(path: str | os.PathLike[str], plan, policy_example, env_example, **kwargs: Any):
    """A :class:`TrajectoryCollector` restored from the checkpoint at ``path``.

    Args:
      plan, policy_example, env_example: as for the collector that was saved; the
        plan must be equal and the examples must give the same buffers.
      kwargs: the collector's other arguments (``writer``, ``tasks``, ``mesh``, ...);
        ``sources`` comes from the checkpoint.

    Raises:
      CheckpointError: not a complete jaxtraj checkpoint, another plan or layout, or
        data that does not match its checksums.
    """
    import orbax.checkpoint as ocp

    from jaxtraj.collector import TrajectoryCollector
    from jaxtraj.types import EnvPart, PolicyPart

    path = Path(path).absolute()
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a complete jaxtraj checkpoint: {e}") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format')!r}, expected {FORMAT}"
        )
    if meta["plan"] != repr(plan):
        raise CheckpointError(
            f"{path} was saved under another plan:\n  saved: {meta['plan']}\n  given: {plan!r}"
        )
    sources = [tuple(s) for s in meta["sources"]]
    collector = TrajectoryCollector(plan, policy_example, env_example, sources=sources, **kwargs)
    target = _tree(collector)
    if str(jax.tree.structure(target)) != meta["treedef"] or _layout(target) != meta["layout"]:
        raise CheckpointError(
            f"{path}: the examples give other buffers than the checkpoint's "
            "(structure, shape or dtype differ)"
        )
    # Host (numpy) targets: restoring there and placing once is faster than orbax's
    # own device placement on CPU.
    host_target = jax.tree.map(lambda x: np.zeros(np.shape(x), _dtype(x)), target)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.restore(path / "state", host_target)
    except Exception as e:  # orbax raises many kinds; all mean the same here
        raise CheckpointError(f"{path}: damaged checkpoint ({type(e).__name__}: {e})") from e
    leaves = jax.tree.leaves(tree)
    bad = [i for i, (a, b) in enumerate(zip(_crc(leaves), meta["crc32"])) if a != b]
    if bad:
        raise CheckpointError(
            f"{path}: damaged checkpoint, {len(bad)} array(s) fail their checksum"
        )
    collector._states = [jax.device_put(s) for s in tree["states"]]
    if tree["episodes"]:
        collector._episodes = [jax.device_put(e) for e in tree["episodes"]]
    host = tree["host"]
    collector._rows = {
        PolicyPart: np.array(host["policy_rows"]),
        EnvPart: np.array(host["env_rows"]),
    }
    collector._step = np.array(host["step"])
    if collector._pipeline:
        collector._flushed = np.array(host["flushed"])
        collector.current_version = int(host["current_version"])
        rng = np.asarray(host["rng"])
        if jax.dtypes.issubdtype(collector._rng.dtype, jax.dtypes.prng_key):
            collector._rng = jax.random.wrap_key_data(rng)
        else:
            collector._rng = jax.numpy.asarray(rng)
    return collector
