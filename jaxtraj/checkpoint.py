"""Checkpoint and restore a ``TrajectoryCollector``.

Everything the collector holds is saved: whatever its ``state_dict()`` returns (the device
states, partial slots and routed fragments included, the host mirror of what has arrived,
the training steps and the output mode's own state). A restore, in a fresh process too,
continues exactly where the checkpoint was taken: flushes are bit-identical. This module
sees the collector only through ``plan``, ``sources``, ``state_dict()`` and
``load_state_dict()``; the tree's contents are the collector's business.

A checkpoint is a folder of two files:

- ``arrays.bin``: every array of the tree, C order, each at a 64-byte aligned offset;
- ``jaxtraj.json``: the format, the plan, the sources, the tree's structure and, per array,
  keyed by its path in the tree (``jax.tree_util.keystr``): shape, dtype, offset, size
  and CRC32.

Both are written and synced in a hidden sibling folder that is then renamed into place, so
a checkpoint is complete or absent. Restoring under another plan or layout, or from a
damaged folder (a missing, truncated or edited file, an array or checksum that does not
match), raises :class:`CheckpointError` naming what differs; nothing is silently restored.

Plain files rather than orbax: restore reads straight into aligned host buffers, which JAX
adopts on CPU without a copy (``benchmarks/checkpoint.py`` measures both against numpy).

    jaxtraj.checkpoint.save(collector, "/ckpt/step_12")
    collector = jaxtraj.checkpoint.restore("/ckpt/step_12", plan, policy_example, env_example)
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

FORMAT = 2
META = "jaxtraj.json"
ARRAYS = "arrays.bin"
ALIGN = 64  # XLA's CPU client adopts host buffers aligned to this without copying


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored: another plan or layout, or damaged."""


def _dtype(x: Any) -> np.dtype:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _named(tree: Any) -> tuple[list[str], list[Any], Any]:
    """The leaves of ``tree`` with their paths as strings, and its structure."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [jax.tree_util.keystr(p) for p, _ in flat]
    if len(set(names)) != len(names):
        raise CheckpointError("the collector's state has two leaves with one path")
    return names, [x for _, x in flat], treedef


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(collector, path: str | os.PathLike[str]) -> None:
    """Write a checkpoint of ``collector`` to the new folder ``path``.

    Raises:
      CheckpointError: ``path`` exists.
    """
    path = Path(path).absolute()
    if path.exists():
        raise CheckpointError(f"{path} exists; checkpoints are written to a new folder")
    names, leaves, treedef = _named(collector.state_dict(copy=False))  # written at once
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        arrays, offset = {}, 0
        with open(tmp / ARRAYS, "wb") as f:
            for name, x in zip(names, leaves):
                a = np.asarray(x, order="C")  # ascontiguousarray would make 0-d 1-d
                data = a.reshape(-1).view(np.uint8)
                pad = -offset % ALIGN
                f.write(b"\0" * pad)
                offset += pad
                f.write(data)
                arrays[name] = {
                    "shape": list(a.shape),
                    "dtype": str(a.dtype),
                    "offset": offset,
                    "nbytes": a.nbytes,
                    "crc32": zlib.crc32(data),
                }
                offset += a.nbytes
            f.flush()
            os.fsync(f.fileno())
        meta = {
            "format": FORMAT,
            "plan": repr(collector.plan),
            "sources": [list(s) for s in collector.sources],
            "treedef": str(treedef),
            "arrays": arrays,
        }
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, path)  # the checkpoint appears whole or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a complete jaxtraj checkpoint: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: checkpoint format {found!r}, expected {FORMAT}")
    for key, kind in (("plan", str), ("sources", list), ("treedef", str), ("arrays", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{path}: damaged checkpoint, {META} has no valid {key!r}")
    return meta


def _entries(path: Path, meta: dict) -> dict[str, tuple[int, int, int]]:
    """Each saved array's ``(offset, nbytes, crc32)``, by path; raise on a damaged entry."""
    out = {}
    for name, entry in meta["arrays"].items():
        entry = entry if isinstance(entry, dict) else {}
        offset, nbytes, crc = (entry.get(k) for k in ("offset", "nbytes", "crc32"))
        if not isinstance(crc, int) or isinstance(crc, bool):
            raise CheckpointError(f"{path}: damaged checkpoint, no checksum for array {name}")
        valid = all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, nbytes))
        if not valid or offset < 0 or nbytes < 0 or offset % ALIGN:
            raise CheckpointError(f"{path}: damaged checkpoint, bad offset for array {name}")
        out[name] = (offset, nbytes, crc)
    return out


def _read(file: Path, entries: dict[str, tuple[int, int, int]]):
    """``file`` read whole into an aligned buffer, and the CRC32 of each entry's bytes."""
    with open(file, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = _aligned(size)
        view, done = memoryview(buf), 0
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    crcs = {
        name: zlib.crc32(buf[offset : offset + nbytes])
        for name, (offset, nbytes, _) in entries.items()
        if offset + nbytes <= done
    }
    return buf, crcs


def _check_layout(path: Path, meta: dict, names: list[str], leaves: list, treedef) -> None:
    """Raise unless the saved arrays are exactly the target's: paths, shapes, dtypes."""
    saved = meta["arrays"]
    missing = [n for n in names if n not in saved]
    extra = [n for n in saved if n not in set(names)]
    differ = []
    for name, x in zip(names, leaves):
        if name not in saved:
            continue
        entry = saved[name]
        want = (list(np.shape(x)), str(_dtype(x)), _nbytes(x))
        got = (entry.get("shape"), entry.get("dtype"), entry.get("nbytes"))
        if got != want:
            differ.append(f"{name} (shape, dtype, nbytes): saved {got}, given {want}")
    if missing or extra or differ or meta["treedef"] != str(treedef):
        lines = [f"not in the checkpoint: {missing}"] if missing else []
        lines += [f"only in the checkpoint: {extra}"] if extra else []
        lines += differ[:8] + ([f"... {len(differ) - 8} more"] if len(differ) > 8 else [])
        if not lines:
            lines = ["the tree's structure differs"]
        raise CheckpointError(
            f"{path}: the examples give other buffers than the checkpoint's "
            "(structure, shape or dtype differ):\n  " + "\n  ".join(lines)
        )


def _nbytes(x: Any) -> int:
    return int(np.prod(np.shape(x), dtype=np.int64)) * _dtype(x).itemsize


def restore(path: str | os.PathLike[str], plan, policy_example, env_example, **kwargs: Any):
    """A :class:`TrajectoryCollector` restored from the checkpoint at ``path``.

    Args:
      plan: the plan of the collector that was saved (an equal one).
      policy_example: as for that collector; it must give the same buffers.
      env_example: as for that collector; it must give the same buffers.
      kwargs: the collector's other arguments (``writer``, ``tasks``, ``mesh``, ...);
        ``sources`` comes from the checkpoint.

    Raises:
      CheckpointError: not a complete jaxtraj checkpoint, another plan or layout, or
        data that does not match its checksums.
    """
    from jaxtraj.collector import TrajectoryCollector

    path = Path(path).absolute()
    meta = _read_meta(path)
    if meta["plan"] != repr(plan):
        raise CheckpointError(
            f"{path} was saved under another plan:\n  saved: {meta['plan']}\n  given: {plan!r}"
        )
    try:
        sources = [(int(r), int(s)) for r, s in meta["sources"]]
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: damaged checkpoint, bad sources: {e}") from e
    entries = _entries(path, meta)
    # Read and checksum in the background while the fresh collector allocates its
    # buffers: both spend their time outside the GIL.
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(_read, path / ARRAYS, entries)
        collector = TrajectoryCollector(
            plan, policy_example, env_example, sources=sources, **kwargs
        )
        names, leaves, treedef = _named(collector.state_dict(copy=False))  # shapes only
        _check_layout(path, meta, names, leaves, treedef)
        try:
            buf, crcs = reading.result()
        except OSError as e:
            raise CheckpointError(f"{path} is not a complete jaxtraj checkpoint: {e}") from e
    short = [n for n in names if n not in crcs]
    if short:
        raise CheckpointError(
            f"{path}: damaged checkpoint, {ARRAYS} is truncated: {', '.join(short)}"
        )
    bad = [n for n in names if crcs[n] != entries[n][2]]
    if bad:
        raise CheckpointError(
            f"{path}: damaged checkpoint, {len(bad)} array(s) fail their checksum: "
            + ", ".join(bad)
        )
    arrays = [
        buf[entries[n][0] : entries[n][0] + _nbytes(x)].view(_dtype(x)).reshape(np.shape(x))
        for n, x in zip(names, leaves)
    ]
    collector.load_state_dict(jax.tree.unflatten(treedef, arrays))
    return collector
