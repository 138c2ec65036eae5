"""Append completed episodes to a LeRobot dataset folder (format ``v3.0``), on the host.

The folder is what LeRobot's ``LeRobotDataset(repo_id, root=folder)`` loads::

    meta/info.json                            format, fps, features, totals: the commit point
    meta/stats.json                           per feature: min max mean std count q01 ... q99
    meta/tasks.parquet                        task_index, and the task as a pandas index "task"
    meta/episodes/chunk-000/file-000.parquet  one row per episode, row i is episode i
    data/chunk-000/file-000.parquet           one row per frame, episodes contiguous

Every data file holds the declared features plus the five LeRobot adds to every frame: ``index``
(0, 1, ... over the whole dataset in row order), ``episode_index``, ``frame_index``,
``task_index`` (int64) and ``timestamp`` (float32, ``frame_index / fps``). A feature of shape
``[1]`` is a scalar column; a feature of shape ``[D]`` is a ``fixed_size_list<D>`` column. Only
numeric rank-1 features are supported: no images, no videos (``video_path`` is null).

Append strategy. ``add_episodes`` starts a new data file for every call, and more than one when
the call's frames would pass ``data_files_size_in_mb`` (measured, like LeRobot's aggregation does,
as uncompressed column bytes); an episode is never split, so an episode larger than the limit gets
a file of its own. Committed data files are never rewritten, so a call costs the same whatever the
dataset's size, but files are as large as the calls: give ``add_episodes`` batches of a few MB (a
collector's flush), not single short episodes, or the dataset fills with small files. The episodes
metadata, about 80 bytes per episode, is appended by rewriting its current file until that file
would pass the same size limit or 1 MiB, whichever is smaller (the cap bounds the rewrite); the
next file index rolls into the next chunk after ``chunks_size`` files, for data and metadata alike.

Crash safety. No file is kept open between calls. Every file is written to a temporary name that
LeRobot's globs (``data/*/*.parquet``, ``meta/episodes/*/*.parquet``) never match,
``.<name>.tmp-<pid>``, and renamed into place with ``os.replace``; ``meta/info.json`` is replaced
last and is the commit point. A process killed at any point leaves every file that the previous
``info.json`` refers to holding exactly its committed rows; what the killed call had already
renamed into place (new data files, trailing metadata rows, new tasks) lies beyond
``total_frames``/``total_episodes``/``total_tasks``, which LeRobot's loader does not index.
``LeRobotWriter.open`` (or the constructor on an existing folder) removes that uncommitted tail
and stray temporary files before appending, so numbering resumes without a gap. Renames are atomic
against process death, not power loss: nothing is fsync'ed. One writer per folder at a time.

Statistics. ``count``, ``min``, ``max``, ``mean`` and ``std`` (population, as LeRobot's) are exact
running aggregates (float64, Chan's parallel update). Quantiles come from a histogram per feature
dimension whose buckets are float32 bit patterns cut to sign, exponent and the top 6 mantissa
bits: a bucket spans 1/64 of a binary octave, so a reported quantile is within 2**-7 (0.8%)
relative of a value between the order statistics that bracket it, clipped to the exact
``[min, max]``. The histogram is a plain count per bucket, so it is deterministic and independent
of how frames were split into calls. Its state is kept in ``meta/.jaxtraj-stats.npz`` (sparse)
so that reopening does not rescan the data; it is rebuilt from the data files when it does not
match ``info.json`` (after a crash). The update runs in a helper thread while the parquet files are
written (both release the GIL); the thread ends within the call.

Example::

    writer = LeRobotWriter("/data/pick", fps=30, features={
        "observation.state": {"dtype": "float32", "shape": [8], "names": None},
        "action": {"dtype": "float32", "shape": [7], "names": None},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.done": {"dtype": "bool", "shape": [1], "names": None},
    })
    writer.add_episodes([{"observation.state": s, "action": a, "next.reward": r,
                          "next.done": d}], tasks=["pick the cube"])
    writer = LeRobotWriter.open("/data/pick")      # later, in another process
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["CODEBASE_VERSION", "DEFAULT_FEATURES", "LeRobotWriter"]

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
STATS_STATE_PATH = "meta/.jaxtraj-stats.npz"
DEFAULT_CHUNKS_SIZE = 1000
DEFAULT_DATA_FILES_SIZE_IN_MB = 100
DEFAULT_VIDEO_FILES_SIZE_IN_MB = 200

# The columns LeRobot adds to every frame, in the order it appends them to the user's features.
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}

_DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float32",
    "float64",
)
# Dictionary encoding pays only on low-cardinality columns; on float observations it builds a
# hash table that overflows and is thrown away, which more than doubles the write time.
_DICTIONARY_COLUMNS = ["episode_index", "task_index", "frame_index"]
_FILE_RE = re.compile(r"chunk-(\d+)/file-(\d+)\.parquet$")
_TMP_MARK = ".tmp-"
# Episodes-metadata row: 8 int64 columns plus the list and string offsets of ``tasks``.
_META_ROW_NBYTES = 8 * 8 + 4 + 4
# Every call rewrites the current episodes-metadata file; capping it (about 11,000 episodes)
# bounds that cost whatever the data file limit.
_META_FILE_MAX_BYTES = 1 << 20


def _commit(tmp: Path, path: Path) -> None:
    """Atomically move a finished temporary file into place (one seam for crash tests)."""
    os.replace(tmp, path)


def _tmp_path(path: Path) -> Path:
    # Dot prefix and a suffix after ".parquet": no LeRobot glob, hidden or not, matches it.
    return path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")


def _write_table(path: Path, table: pa.Table, **options: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    pq.write_table(table, tmp, **options)
    _commit(tmp, path)


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    tmp.write_bytes(data)
    _commit(tmp, path)


def _write_json(path: Path, obj: Any, indent: int | None = 4) -> None:
    _write_bytes(path, (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode())


def _next_location(loc: tuple[int, int] | None, chunks_size: int) -> tuple[int, int]:
    """The (chunk, file) index after ``loc``: files roll into the next chunk after chunks_size."""
    if loc is None:
        return 0, 0
    chunk, file = loc
    return (chunk + 1, 0) if file + 1 >= chunks_size else (chunk, file + 1)


def _location(path: Path) -> tuple[int, int] | None:
    match = _FILE_RE.search(path.as_posix())
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def _located_files(root: Path, pattern: str) -> list[tuple[tuple[int, int], Path]]:
    """Files matching a LeRobot glob that follow the chunk/file naming, in (chunk, file) order."""
    found = [(_location(p), p) for p in root.glob(pattern)]
    return sorted((loc, p) for loc, p in found if loc is not None)


def _check_features(features: Any) -> dict[str, dict[str, Any]]:
    """Validate declared features; return them as info.json stores them (shape a list)."""
    if not isinstance(features, Mapping) or not features:
        raise ValueError(f"features must be a non-empty dict of name -> spec, got {features!r}")
    out: dict[str, dict[str, Any]] = {}
    for name, spec in features.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"feature names must be non-empty strings, got {name!r}")
        if "/" in name:
            raise ValueError(f"feature name {name!r} contains '/', which LeRobot forbids")
        if name in DEFAULT_FEATURES:
            raise ValueError(f"feature {name!r} is written by the writer; do not declare it")
        if not isinstance(spec, Mapping):
            raise ValueError(f"feature {name!r}: spec must be a dict, got {spec!r}")
        unknown = set(spec) - {"dtype", "shape", "names"}
        if unknown:
            raise ValueError(f"feature {name!r}: unknown keys {sorted(unknown)}")
        dtype = spec.get("dtype")
        if dtype not in _DTYPES:
            raise ValueError(
                f"feature {name!r}: dtype {dtype!r} is not supported (one of {', '.join(_DTYPES)};"
                " images and videos are not)"
            )
        shape = spec.get("shape")
        if (
            not isinstance(shape, Sequence)
            or len(shape) != 1
            or not isinstance(shape[0], int | np.integer)
            or isinstance(shape[0], bool)
            or shape[0] < 1
        ):
            raise ValueError(f"feature {name!r}: shape must be [D] with D >= 1, got {shape!r}")
        names = spec.get("names")
        if isinstance(names, Sequence) and not isinstance(names, str):
            if len(names) != shape[0] or not all(isinstance(n, str) for n in names):
                raise ValueError(
                    f"feature {name!r}: names must be {shape[0]} strings, got {names!r}"
                )
            names = list(names)
        elif names is not None and not isinstance(names, Mapping):
            raise ValueError(
                f"feature {name!r}: names must be null, a list or a dict, got {names!r}"
            )
        out[name] = {"dtype": dtype, "shape": [int(shape[0])], "names": names}
    return out


def _arrow_type(spec: Mapping[str, Any]) -> pa.DataType:
    scalar = pa.from_numpy_dtype(np.dtype(spec["dtype"]))
    width = spec["shape"][0]
    return scalar if width == 1 else pa.list_(scalar, width)


def _to_arrow(values: np.ndarray) -> pa.Array:
    if values.ndim == 1:
        return pa.array(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def _to_numpy(column: pa.ChunkedArray, width: int) -> np.ndarray:
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        array = array.flatten()
    return array.to_numpy(zero_copy_only=False).reshape(-1, width)


def _tasks_table(tasks: Sequence[str]) -> pa.Table:
    """``meta/tasks.parquet`` as pandas writes a frame indexed by a ``task`` index.

    The pandas metadata makes ``pandas.read_parquet`` restore the index, whose name LeRobot reads
    back as the task string; it is written by hand so that this module does not need pandas.
    """
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {
                "name": "task",
                "field_name": "task",
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": None,
            },
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    schema = pa.schema(
        [("task_index", pa.int64()), ("task", pa.string())],
        metadata={"pandas": json.dumps(pandas_meta)},
    )
    return pa.table([np.arange(len(tasks), dtype=np.int64), list(tasks)], schema=schema)


# Quantile histogram: a float32's bits mapped to a signed integer that orders like the value
# (negative floats have their magnitude bits flipped), then cut to the top _BUCKET_BITS bits:
# sign, 8 exponent bits and 6 mantissa bits.
_BUCKET_BITS = 15
_NUM_BUCKETS = 1 << _BUCKET_BITS
_SHIFT = 32 - _BUCKET_BITS


def _bucket_values() -> np.ndarray:
    """The midpoint of every bucket's value range, float64 ``[_NUM_BUCKETS]``."""
    first = (np.arange(_NUM_BUCKETS, dtype=np.int64) - _NUM_BUCKETS // 2) << _SHIFT
    ends = []
    # The buckets of infinities and NaNs get meaningless midpoints; finite input never uses them.
    with np.errstate(invalid="ignore", over="ignore"):
        for key in (first, first + (1 << _SHIFT) - 1):
            key = key.astype(np.int32)
            bits = key ^ ((key >> 31) & 0x7FFFFFFF)
            ends.append(bits.view(np.float32).astype(np.float64))
        return (ends[0] + ends[1]) / 2


_BUCKET_VALUES = _bucket_values()


class _RunningStats:
    """Exact count, min, max, mean and M2, and a sparse bucket histogram, of one feature.

    The histogram is two sorted arrays: ``keys`` (dimension << _BUCKET_BITS | bucket) and
    ``counts``, so that its cost follows the occupied buckets, not all 2**15 of every dimension.
    """

    def __init__(self, width: int):
        self.width = width
        self.count = 0
        self.mean = np.zeros(width)
        self.m2 = np.zeros(width)
        self.min = np.full(width, np.inf)
        self.max = np.full(width, -np.inf)
        self.keys = np.zeros(0, dtype=np.int64)
        self.counts = np.zeros(0, dtype=np.int64)

    def merged(self, values: np.ndarray) -> _RunningStats:
        """Return the statistics of the frames seen so far plus ``values`` ``[n, D]``, n >= 1."""
        n, width = values.shape
        # A reduction over axis 0 of a narrow [n, D] array runs a short inner loop per row;
        # viewed as [n / G, G * D] it vectorises and is about 10x faster.
        group = max(1, 2048 // width)
        body = (n // group) * group
        parts = [p for p in (values[:body].reshape(-1, group * width), values[body:]) if len(p)]
        lo = np.min([p.min(0).reshape(-1, width).min(0) for p in parts], axis=0)
        hi = np.max([p.max(0).reshape(-1, width).max(0) for p in parts], axis=0)
        # Sums of (x - c) and (x - c)**2 in float64, c the first frame, so that a large common
        # offset does not cancel the variance away; converted to float64 in cache-sized blocks.
        shift = values[0].astype(np.float64)
        s1 = np.zeros(width)
        s2 = np.zeros(width)
        for part in parts:
            tiled = np.tile(shift, part.shape[1] // width)
            rows = max(1, (1 << 14) // part.shape[1])
            acc1 = np.zeros(part.shape[1])
            acc2 = np.zeros(part.shape[1])
            for start in range(0, len(part), rows):
                block = part[start : start + rows].astype(np.float64)
                block -= tiled
                acc1 += block.sum(0)
                acc2 += np.einsum("ij,ij->j", block, block)
            s1 += acc1.reshape(-1, width).sum(0)
            s2 += acc2.reshape(-1, width).sum(0)
        batch_mean = shift + s1 / n
        batch_m2 = np.maximum(s2 - s1 * s1 / n, 0.0)

        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.int32)
        keys = bits >> 31
        keys &= 0x7FFFFFFF
        keys ^= bits
        keys >>= _SHIFT
        keys = keys.astype(np.int64 if width >= 1 << 16 else np.int32, copy=False)
        keys += (np.arange(width, dtype=keys.dtype) << _BUCKET_BITS) + _NUM_BUCKETS // 2
        keys = keys.reshape(-1)
        keys.sort()
        first = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
        new_counts = np.diff(np.append(first, len(keys)))
        new_keys = keys[first].astype(np.int64)
        # Both key arrays are sorted: add to the buckets already there, insert the others.
        at = np.searchsorted(self.keys, new_keys)
        seen = at < len(self.keys)
        seen[seen] = self.keys[at[seen]] == new_keys[seen]
        counts = self.counts.copy()
        counts[at[seen]] += new_counts[seen]

        out = _RunningStats(width)
        total = self.count + n
        delta = batch_mean - self.mean
        out.count = total
        out.mean = self.mean + delta * (n / total)
        out.m2 = self.m2 + batch_m2 + delta * delta * (self.count * n / total)
        out.min = np.minimum(self.min, lo)
        out.max = np.maximum(self.max, hi)
        out.keys = np.insert(self.keys, at[~seen], new_keys[~seen])
        out.counts = np.insert(counts, at[~seen], new_counts[~seen])
        return out

    def quantiles(self) -> dict[str, np.ndarray]:
        """Approximate quantiles per dimension: numpy's linear method over bucket midpoints."""
        cumulative = np.cumsum(self.counts)
        # Frames counted before dimension d's buckets: each dimension holds self.count frames.
        base = np.arange(self.width) * self.count
        out = {}
        for key, q in QUANTILES.items():
            rank = q * (self.count - 1)
            ends = []
            for order_statistic in (np.floor(rank), np.ceil(rank)):
                at = np.searchsorted(cumulative, base + order_statistic, side="right")
                ends.append(_BUCKET_VALUES[self.keys[at] & (_NUM_BUCKETS - 1)])
            value = ends[0] + (rank - np.floor(rank)) * (ends[1] - ends[0])
            out[key] = np.clip(value, self.min, self.max)
        return out

    def to_json(self) -> dict[str, list[float] | list[int]]:
        """The feature's entry of ``meta/stats.json``."""
        stats: dict[str, list[float] | list[int]] = {
            "min": self.min.tolist(),
            "max": self.max.tolist(),
            "mean": self.mean.tolist(),
            "std": np.sqrt(self.m2 / max(self.count, 1)).tolist(),
            "count": [int(self.count)],
        }
        stats.update({key: value.tolist() for key, value in self.quantiles().items()})
        return stats


def _pack_stats(stats: Mapping[str, _RunningStats], num_frames: int) -> dict[str, np.ndarray]:
    """Every feature's running statistics as a few flat arrays, for ``meta/.jaxtraj-stats.npz``."""
    values = list(stats.values())
    return {
        "num_frames": np.array(num_frames, dtype=np.int64),
        "names": np.array(list(stats)),
        "count": np.array([s.count for s in values], dtype=np.int64),
        "moments": np.concatenate([np.stack([s.mean, s.m2, s.min, s.max]) for s in values], 1),
        "num_keys": np.array([len(s.keys) for s in values], dtype=np.int64),
        "keys": np.concatenate([s.keys for s in values]),
        "counts": np.concatenate([s.counts for s in values]),
    }


def _unpack_stats(
    state: Mapping[str, np.ndarray], features: Mapping[str, Mapping[str, Any]]
) -> dict[str, _RunningStats]:
    """Inverse of ``_pack_stats``; raises ValueError if it does not fit ``features``."""
    if list(state["names"]) != list(features):
        raise ValueError("stats state lists other features")
    widths = [spec["shape"][0] for spec in features.values()]
    moments = np.split(np.asarray(state["moments"], dtype=np.float64), np.cumsum(widths)[:-1], 1)
    bounds = np.cumsum(state["num_keys"])[:-1]
    out = {}
    for name, width, count, moment, keys, counts in zip(
        features,
        widths,
        state["count"],
        moments,
        np.split(state["keys"], bounds),
        np.split(state["counts"], bounds),
    ):
        stats = _RunningStats(width)
        stats.count = int(count)
        stats.mean, stats.m2, stats.min, stats.max = (row.copy() for row in moment)
        stats.keys, stats.counts = keys.astype(np.int64), counts.astype(np.int64)
        if moment.shape != (4, width) or int(stats.counts.sum()) != stats.count * width:
            raise ValueError(f"stats state of {name!r} is inconsistent")
        out[name] = stats
    return out


class LeRobotWriter:
    """Appends completed episodes to a LeRobot ``v3.0`` dataset folder, one call at a time.

    Creates the dataset when ``root`` is missing or empty; resumes it when ``root`` holds a
    dataset with the same fps, robot type and features (and, where given, the same file sizes),
    after removing what a killed writer left uncommitted. Anything else raises ``ValueError``
    before a byte is written.

    Args:
        root: The dataset folder.
        fps: Frames per second, a positive int; ``timestamp = frame_index / fps``.
        features: The per-frame features besides LeRobot's five bookkeeping columns, name ->
            ``{"dtype": "float32", "shape": [D], "names": None}``. dtype is a numpy bool, int,
            uint or float name (not float16); shape ``[1]`` is a scalar column; ``names`` is
            null, D strings, or a dict as LeRobot allows. Names may not contain ``/``.
        robot_type: Stored in ``info.json``; may be None.
        data_files_size_in_mb: Size limit of a data (and episodes-metadata) file, in MiB of
            uncompressed column data; default 100, or the dataset's own when resuming.
        chunks_size: Files per chunk folder; default 1000, or the dataset's own when resuming.

    Example::

        writer = LeRobotWriter(root, fps=10, features={
            "observation.state": {"dtype": "float32", "shape": [4], "names": None}})
        writer.add_episodes([{"observation.state": np.zeros((50, 4), np.float32)}], ["reach"])
        assert (writer.num_episodes, writer.num_frames) == (1, 50)
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fps: int,
        features: Mapping[str, Mapping[str, Any]],
        robot_type: str | None = None,
        data_files_size_in_mb: float | None = None,
        chunks_size: int | None = None,
    ):
        if not isinstance(fps, int | np.integer) or isinstance(fps, bool) or fps <= 0:
            raise ValueError(f"fps must be a positive int, got {fps!r}")
        if robot_type is not None and not isinstance(robot_type, str):
            raise ValueError(f"robot_type must be a string or None, got {robot_type!r}")
        if data_files_size_in_mb is not None and (
            isinstance(data_files_size_in_mb, bool)
            or not isinstance(data_files_size_in_mb, int | float)
            or not data_files_size_in_mb > 0
        ):
            raise ValueError(f"data_files_size_in_mb must be > 0, got {data_files_size_in_mb!r}")
        if chunks_size is not None and (
            isinstance(chunks_size, bool) or not isinstance(chunks_size, int) or chunks_size < 1
        ):
            raise ValueError(f"chunks_size must be a positive int, got {chunks_size!r}")
        user_features = _check_features(features)
        self._root = Path(root)
        self._features = {**user_features, **DEFAULT_FEATURES}
        self._schema = pa.schema([(k, _arrow_type(v)) for k, v in self._features.items()])
        self._frame_nbytes = sum(
            np.dtype(v["dtype"]).itemsize * v["shape"][0] for v in self._features.values()
        )

        info_path = self._root / INFO_PATH
        if info_path.is_file():
            info = self._check_existing(
                info_path, fps, robot_type, data_files_size_in_mb, chunks_size
            )
        else:
            self._check_empty()
            info = {
                "codebase_version": CODEBASE_VERSION,
                "fps": int(fps),
                "features": self._features,
                "total_episodes": 0,
                "total_frames": 0,
                "total_tasks": 0,
                "chunks_size": chunks_size or DEFAULT_CHUNKS_SIZE,
                "data_files_size_in_mb": data_files_size_in_mb or DEFAULT_DATA_FILES_SIZE_IN_MB,
                "video_files_size_in_mb": DEFAULT_VIDEO_FILES_SIZE_IN_MB,
                "data_path": DATA_PATH,
                "video_path": None,
                "robot_type": robot_type,
                "splits": {"train": "0:0"},
            }
        self._info = info
        self._tasks: list[str] = []
        self._task_index: dict[str, int] = {}
        self._data_loc: tuple[int, int] | None = None
        self._meta_loc: tuple[int, int] | None = None
        self._meta_table: pa.Table | None = None
        self._meta_nbytes = 0
        self._stats = {k: _RunningStats(v["shape"][0]) for k, v in self._features.items()}
        if info_path.is_file():
            self._resume()
        else:
            _write_json(info_path, info)

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> LeRobotWriter:
        """Resume appending to the dataset at ``root`` with the settings in its ``info.json``.

        Args:
            root: A dataset folder this writer (or LeRobot, for numeric features) created.

        Returns:
            A writer whose next episode is ``total_episodes`` and next frame ``total_frames``.
        """
        info = cls._read_info(Path(root) / INFO_PATH)
        features = dict(info.get("features") or {})
        for name, spec in DEFAULT_FEATURES.items():
            if features.pop(name, None) != spec:
                raise ValueError(f"{root}: feature {name!r} is missing or not {spec}")
        return cls(
            root,
            fps=info.get("fps"),
            features=features,
            robot_type=info.get("robot_type"),
            data_files_size_in_mb=info.get("data_files_size_in_mb"),
            chunks_size=info.get("chunks_size"),
        )

    @property
    def root(self) -> Path:
        """The dataset folder."""
        return self._root

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        """Every per-frame feature as ``info.json`` lists it, bookkeeping columns included."""
        return json.loads(json.dumps(self._features))

    @property
    def num_episodes(self) -> int:
        """Committed episodes: the next episode's ``episode_index``."""
        return self._info["total_episodes"]

    @property
    def num_frames(self) -> int:
        """Committed frames: the next frame's ``index``."""
        return self._info["total_frames"]

    @property
    def tasks(self) -> tuple[str, ...]:
        """Task strings in ``task_index`` order."""
        return tuple(self._tasks)

    def add_episodes(self, episodes: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> range:
        """Append completed episodes and commit them with one ``info.json`` rename.

        All input is checked before anything is written. Arrays are converted with numpy's
        ``same_kind`` casting (float64 -> float32 and int -> float are fine; float -> int,
        anything -> bool and out-of-range integers are not); float values must be finite.

        Args:
            episodes: One dict per episode: every declared feature -> array ``[L]`` or
                ``[L, 1]`` for shape ``[1]``, ``[L, D]`` for shape ``[D]``, with one ``L >= 1``
                per episode. JAX arrays are fine (they are copied to the host).
            tasks: One non-empty task string per episode.

        Returns:
            The episode indices assigned, ``range(num_episodes_before, num_episodes_after)``.
        """
        columns, lengths = self._validate(episodes, tasks)
        first_episode, first_frame = self.num_episodes, self.num_frames
        if not lengths:
            return range(first_episode, first_episode)

        task_index = dict(self._task_index)
        all_tasks = list(self._tasks)
        for task in tasks:
            if task not in task_index:
                task_index[task] = len(all_tasks)
                all_tasks.append(task)
        lengths_np = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(lengths_np)
        starts = ends - lengths_np
        num_frames = int(ends[-1])
        frame_index = np.arange(num_frames, dtype=np.int64) - np.repeat(starts, lengths_np)
        columns["timestamp"] = (frame_index / self._info["fps"]).astype(np.float32)
        columns["frame_index"] = frame_index
        columns["episode_index"] = np.repeat(
            np.arange(first_episode, first_episode + len(lengths), dtype=np.int64), lengths_np
        )
        columns["index"] = np.arange(first_frame, first_frame + num_frames, dtype=np.int64)
        columns["task_index"] = np.repeat(
            np.array([task_index[t] for t in tasks], dtype=np.int64), lengths_np
        )
        table = pa.Table.from_arrays(
            [_to_arrow(columns[name]) for name in self._schema.names], schema=self._schema
        )
        # The statistics update (numpy, mostly without the GIL) runs beside the parquet writes
        # (C++, without the GIL): on two cores that hides most of its cost.
        result: dict[str, Any] = {}
        worker = threading.Thread(
            target=self._merge_stats, args=(columns, num_frames, result), daemon=True
        )
        worker.start()
        try:
            data_loc, meta_loc, meta_table, meta_nbytes = self._write_data_and_metadata(
                table, tasks, lengths_np, all_tasks, first_episode, first_frame
            )
        finally:
            worker.join()
        if "error" in result:
            raise result["error"]
        self._write_stats(result["stats"], first_frame + num_frames, result["json"])

        info = dict(self._info)
        info["total_episodes"] = first_episode + len(lengths)
        info["total_frames"] = first_frame + num_frames
        info["total_tasks"] = len(all_tasks)
        info["splits"] = {"train": f"0:{info['total_episodes']}"}
        _write_json(self._root / INFO_PATH, info)

        # Committed: only now does the in-memory state move, so a failed call can be retried.
        self._info = info
        self._tasks, self._task_index = all_tasks, task_index
        self._data_loc = data_loc
        self._meta_loc, self._meta_table, self._meta_nbytes = meta_loc, meta_table, meta_nbytes
        self._stats = result["stats"]
        return range(first_episode, info["total_episodes"])

    def _merge_stats(
        self, columns: Mapping[str, np.ndarray], num_frames: int, result: dict[str, Any]
    ) -> None:
        """Thread body: the statistics with ``columns`` added, and their stats.json entries."""
        try:
            stats = {
                name: self._stats[name].merged(columns[name].reshape(num_frames, -1))
                for name in self._features
            }
            result["json"] = {name: s.to_json() for name, s in stats.items()}
            result["stats"] = stats
        except BaseException as err:  # re-raised by the caller's thread
            result["error"] = err

    def _write_data_and_metadata(
        self,
        table: pa.Table,
        tasks: Sequence[str],
        lengths_np: np.ndarray,
        all_tasks: list[str],
        first_episode: int,
        first_frame: int,
    ) -> tuple[tuple[int, int], tuple[int, int], pa.Table | None, int]:
        """Write the call's data files, episodes-metadata rows and tasks; commit nothing else.

        Returns:
            The new last data file location, and the current episodes-metadata file's
            location, content and estimated size.
        """
        limit = float(self._info["data_files_size_in_mb"]) * (1 << 20)
        chunks_size = self._info["chunks_size"]
        lengths = lengths_np.tolist()
        ends = np.cumsum(lengths_np)
        starts = ends - lengths_np

        # Data files: greedy, whole episodes, a new file before one would pass the limit.
        data_loc = self._data_loc
        episode_locs: list[tuple[int, int]] = []
        group_start = 0
        for i in range(len(lengths) + 1):
            frames = int(ends[i - 1] - starts[group_start]) if i > group_start else 0
            if i < len(lengths) and (
                i == group_start or (frames + lengths[i]) * self._frame_nbytes <= limit
            ):
                continue
            data_loc = _next_location(data_loc, chunks_size)
            episode_locs += [data_loc] * (i - group_start)
            offset = int(starts[group_start])
            _write_table(
                self._root / DATA_PATH.format(chunk_index=data_loc[0], file_index=data_loc[1]),
                table.slice(offset, frames),
                compression="snappy",
                use_dictionary=_DICTIONARY_COLUMNS,
            )
            group_start = i

        # Episodes metadata: fill the current file, then new ones, row i being episode i.
        meta_loc, meta_table, meta_nbytes = self._meta_loc, self._meta_table, self._meta_nbytes
        meta_limit = min(limit, _META_FILE_MAX_BYTES)
        if meta_loc is None:
            meta_loc = _next_location(None, chunks_size)
        pending: list[int] = []
        meta_locs: list[tuple[int, int]] = []
        to_write: list[tuple[tuple[int, int], pa.Table | None, list[int]]] = []
        for i, task in enumerate(tasks):
            row_nbytes = _META_ROW_NBYTES + len(task.encode())
            if (meta_table is not None or pending) and meta_nbytes + row_nbytes > meta_limit:
                to_write.append((meta_loc, meta_table, pending))
                meta_loc, meta_table, meta_nbytes, pending = (
                    _next_location(meta_loc, chunks_size),
                    None,
                    0,
                    [],
                )
            pending.append(i)
            meta_locs.append(meta_loc)
            meta_nbytes += row_nbytes
        to_write.append((meta_loc, meta_table, pending))
        rows = {
            "episode_index": pa.array(np.arange(first_episode, first_episode + len(lengths))),
            "tasks": pa.array([[t] for t in tasks], type=pa.list_(pa.string())),
            "length": pa.array(lengths_np),
            "data/chunk_index": pa.array([loc[0] for loc in episode_locs], type=pa.int64()),
            "data/file_index": pa.array([loc[1] for loc in episode_locs], type=pa.int64()),
            "dataset_from_index": pa.array(first_frame + starts),
            "dataset_to_index": pa.array(first_frame + ends),
            "meta/episodes/chunk_index": pa.array([loc[0] for loc in meta_locs], type=pa.int64()),
            "meta/episodes/file_index": pa.array([loc[1] for loc in meta_locs], type=pa.int64()),
        }
        new_rows = pa.table(rows)
        for loc, existing, members in to_write:
            if not members:
                continue  # the current file was already full: it stays as it is
            part = new_rows.slice(members[0], len(members))
            if existing is not None:
                # promote: a LeRobot-recorded file may carry per-episode stats columns; new rows
                # get nulls there rather than a second schema in the same folder.
                part = pa.concat_tables([existing, part], promote_options="default")
            meta_table = part
            _write_table(
                self._root / EPISODES_PATH.format(chunk_index=loc[0], file_index=loc[1]),
                meta_table,
                compression="snappy",
            )

        if len(all_tasks) > len(self._tasks):
            _write_table(self._root / TASKS_PATH, _tasks_table(all_tasks))
        return data_loc, meta_loc, meta_table, meta_nbytes

    # ----------------------------------------------------------------------------------------
    # Validation.

    def _validate(
        self, episodes: Sequence[Mapping[str, Any]], tasks: Sequence[str]
    ) -> tuple[dict[str, np.ndarray], list[int]]:
        """Check every episode and task; return the concatenated, cast columns and lengths."""
        if isinstance(episodes, Mapping) or not isinstance(episodes, Sequence):
            raise ValueError("episodes must be a list of dicts, one per episode")
        if isinstance(tasks, str) or not isinstance(tasks, Sequence):
            raise ValueError("tasks must be a list of strings, one per episode")
        if len(tasks) != len(episodes):
            raise ValueError(f"got {len(episodes)} episodes but {len(tasks)} tasks")
        user = {k: v for k, v in self._features.items() if k not in DEFAULT_FEATURES}
        parts: dict[str, list[np.ndarray]] = {name: [] for name in user}
        lengths: list[int] = []
        for i, (episode, task) in enumerate(zip(episodes, tasks)):
            if not isinstance(task, str) or not task.strip():
                raise ValueError(f"episode {i}: task must be a non-empty string, got {task!r}")
            if not isinstance(episode, Mapping):
                raise ValueError(f"episode {i}: expected a dict of arrays, got {type(episode)}")
            missing = sorted(set(user) - set(episode))
            extra = sorted(set(episode) - set(user))
            if missing or extra:
                raise ValueError(
                    f"episode {i}: missing features {missing}, undeclared features {extra}"
                    " (the writer fills index, episode_index, frame_index, task_index, timestamp)"
                )
            length = None
            for name, spec in user.items():
                array = np.asarray(episode[name])
                width, target = spec["shape"][0], np.dtype(spec["dtype"])
                if width == 1 and array.ndim == 2 and array.shape[1] == 1:
                    array = array[:, 0]
                expected = (array.shape[0],) if width == 1 else (array.shape[0], width)
                if array.ndim == 0 or array.shape != expected:
                    want = "[length]" if width == 1 else f"[length, {width}]"
                    raise ValueError(
                        f"episode {i}: feature {name!r} has shape {list(array.shape)},"
                        f" expected {want}"
                    )
                if length is None:
                    length = array.shape[0]
                    if length == 0:
                        raise ValueError(f"episode {i}: has no frames")
                elif array.shape[0] != length:
                    raise ValueError(
                        f"episode {i}: feature {name!r} has {array.shape[0]} frames,"
                        f" the others {length}"
                    )
                if array.dtype.kind not in "biuf" or not np.can_cast(
                    array.dtype, target, casting="same_kind"
                ):
                    raise ValueError(
                        f"episode {i}: feature {name!r} has dtype {array.dtype}, which does not"
                        f" convert to {target} (same_kind casting)"
                    )
                if target.kind in "iu" and not np.can_cast(array.dtype, target, casting="safe"):
                    info = np.iinfo(target)
                    if array.min() < info.min or array.max() > info.max:
                        raise ValueError(
                            f"episode {i}: feature {name!r} has values outside {target}'s range"
                        )
                parts[name].append(array)
            lengths.append(int(length or 0))
        columns: dict[str, np.ndarray] = {}
        for name, spec in user.items():
            target = np.dtype(spec["dtype"])
            if not parts[name]:
                break
            # Overflow to inf (float64 -> float32) is reported just below, naming the episode.
            with np.errstate(over="ignore", invalid="ignore"):
                column = np.concatenate(parts[name], dtype=target, casting="same_kind")
            if target.kind == "f":
                finite = np.isfinite(column)
                if not finite.all():
                    frame = int(np.flatnonzero(~finite.reshape(len(column), -1).all(1))[0])
                    episode = int(np.searchsorted(np.cumsum(lengths), frame, side="right"))
                    raise ValueError(
                        f"episode {episode}: feature {name!r} has non-finite values"
                        f" (after conversion to {target})"
                    )
            columns[name] = column
        return columns, lengths

    # ----------------------------------------------------------------------------------------
    # Opening an existing folder.

    @staticmethod
    def _read_info(path: Path) -> dict[str, Any]:
        if not path.is_file():
            raise ValueError(f"{path.parent.parent}: no meta/info.json, not a LeRobot dataset")
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: unreadable info.json ({err})") from None
        if not isinstance(info, dict):
            raise ValueError(f"{path}: info.json is not an object")
        version = info.get("codebase_version")
        if version != CODEBASE_VERSION:
            raise ValueError(
                f"{path}: codebase_version is {version!r}; this writer appends only to"
                f" {CODEBASE_VERSION!r} datasets"
            )
        return info

    def _check_empty(self) -> None:
        if self._root.exists() and not self._root.is_dir():
            raise ValueError(f"{self._root} exists and is not a folder")
        if self._root.is_dir():
            # Temporary files and empty folders are what a writer killed at creation leaves.
            stray = [p for p in self._root.rglob("*") if p.is_file() and _TMP_MARK not in p.name]
            if stray:
                raise ValueError(
                    f"{self._root} is not empty and has no meta/info.json (found"
                    f" {stray[0].relative_to(self._root)}); refusing to write a dataset into it"
                )

    def _check_existing(
        self,
        path: Path,
        fps: int,
        robot_type: str | None,
        data_files_size_in_mb: float | None,
        chunks_size: int | None,
    ) -> dict[str, Any]:
        info = self._read_info(path)
        theirs = info.get("features")
        if not isinstance(theirs, dict):
            raise ValueError(f"{path}: features is not an object")
        if theirs != self._features:
            missing = sorted(set(self._features) - set(theirs))
            extra = sorted(set(theirs) - set(self._features))
            changed = sorted(
                k for k in set(theirs) & set(self._features) if theirs[k] != self._features[k]
            )
            raise ValueError(
                f"{path}: features differ from the dataset's: not in the dataset {missing},"
                f" only in the dataset {extra}, different spec {changed}"
            )
        expected = {
            "fps": fps,
            "robot_type": robot_type,
            "data_path": DATA_PATH,
            "video_path": None,
        }
        if data_files_size_in_mb is not None:
            expected["data_files_size_in_mb"] = data_files_size_in_mb
        if chunks_size is not None:
            expected["chunks_size"] = chunks_size
        for key, value in expected.items():
            if info.get(key) != value:
                raise ValueError(f"{path}: {key} is {info.get(key)!r}, not {value!r}")
        for key in ("total_episodes", "total_frames", "total_tasks", "chunks_size"):
            if not isinstance(info.get(key), int) or info[key] < (1 if key == "chunks_size" else 0):
                raise ValueError(f"{path}: {key} is {info.get(key)!r}")
        size = info.get("data_files_size_in_mb")
        if isinstance(size, bool) or not isinstance(size, int | float) or not size > 0:
            raise ValueError(f"{path}: data_files_size_in_mb is {size!r}")
        return info

    def _resume(self) -> None:
        """Load the committed state, then drop what an interrupted call left beyond it.

        Everything is read and checked first; files change only once the whole folder is known
        to be consistent up to ``info.json``'s totals, so a folder that is not raises untouched.
        """
        root = self._root
        num_episodes, num_frames, num_tasks = (
            self._info["total_episodes"],
            self._info["total_frames"],
            self._info["total_tasks"],
        )
        remove = [
            tmp
            for pattern in ("meta/.*", "meta/episodes/*/.*", "data/*/.*")
            for tmp in root.glob(pattern + _TMP_MARK + "*")
        ]
        rewrite: list[tuple[Path, pa.Table, dict[str, Any]]] = []

        # Episodes metadata: rows below total_episodes are committed, and come first.
        committed: list[pa.Table] = []
        for loc, path in _located_files(root, "meta/episodes/*/*.parquet"):
            table = pq.read_table(path)
            if "episode_index" not in table.column_names:
                raise ValueError(f"{path}: no episode_index column")
            keep = int(np.sum(table.column("episode_index").to_numpy() < num_episodes))
            if keep == 0:
                remove.append(path)
                continue
            if keep < table.num_rows:
                table = table.slice(0, keep)
                rewrite.append((path, table, {"compression": "snappy"}))
            committed.append(table)
            self._meta_loc, self._meta_table, self._meta_nbytes = loc, table, table.nbytes
        needed = [
            "episode_index",
            "length",
            "data/chunk_index",
            "data/file_index",
            "dataset_from_index",
            "dataset_to_index",
        ]
        cols = {c: np.zeros(0, dtype=np.int64) for c in needed}
        if committed:
            episodes = pa.concat_tables(committed, promote_options="default")
            missing = [c for c in needed if c not in episodes.column_names]
            if missing:
                raise ValueError(f"{root}: episodes metadata lacks columns {missing}")
            cols = {c: episodes.column(c).to_numpy() for c in needed}
        if (
            not np.array_equal(cols["episode_index"], np.arange(num_episodes))
            or int(cols["length"].sum()) != num_frames
            or (num_episodes and int(cols["dataset_to_index"][-1]) != num_frames)
        ):
            raise ValueError(
                f"{root}: episodes metadata does not match info.json"
                f" ({num_episodes} episodes, {num_frames} frames)"
            )

        # Data files: the committed ones end with the last committed episode's file.
        last = None
        if num_episodes:
            last = (int(cols["data/chunk_index"][-1]), int(cols["data/file_index"][-1]))
            in_last = (cols["data/chunk_index"] == last[0]) & (cols["data/file_index"] == last[1])
            path = root / DATA_PATH.format(chunk_index=last[0], file_index=last[1])
            if (
                not path.is_file()
                or pq.read_metadata(path).num_rows != cols["length"][in_last].sum()
            ):
                raise ValueError(f"{path}: missing, or its rows do not match the episodes metadata")
        data_files = []
        for loc, path in _located_files(root, "data/*/*.parquet"):
            (remove if last is None or loc > last else data_files).append(path)
        self._data_loc = last

        # Tasks: appended in task_index order, so the committed ones are a prefix.
        path = root / TASKS_PATH
        if not num_tasks and path.is_file():
            remove.append(path)
        elif num_tasks:
            table = pq.read_table(path) if path.is_file() else None
            name = next(
                (c for c in ("task", "__index_level_0__") if table and c in table.column_names),
                None,
            )
            if table is None or name is None or table.num_rows < num_tasks:
                raise ValueError(f"{path}: missing, or fewer than {num_tasks} tasks")
            order = np.argsort(table.column("task_index").to_numpy(), kind="stable")
            self._tasks = [table.column(name)[int(i)].as_py() for i in order[:num_tasks]]
            if table.num_rows > num_tasks:
                rewrite.append((path, _tasks_table(self._tasks), {}))
        self._task_index = {task: i for i, task in enumerate(self._tasks)}

        # Statistics: the saved state if it matches info.json, else a rescan of the data.
        stats = self._load_stats_state(num_frames)
        stale = stats is None
        if stats is None:
            stats = self._rebuild_stats(data_files)
        else:
            try:
                saved = json.loads((root / STATS_PATH).read_text())
                stale = saved["index"]["count"] != [num_frames]
            except (OSError, ValueError, KeyError, TypeError):
                stale = True
        if not num_frames:
            remove += [p for p in (root / STATS_PATH, root / STATS_STATE_PATH) if p.is_file()]
        self._stats = stats

        # Consistent: now drop the uncommitted tail.
        for path, table, options in rewrite:
            _write_table(path, table, **options)
        for path in remove:
            path.unlink()
        if num_frames and stale:
            self._write_stats(stats, num_frames)

    def _load_stats_state(self, num_frames: int) -> dict[str, _RunningStats] | None:
        path = self._root / STATS_STATE_PATH
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as state:
                if int(state["num_frames"]) != num_frames:
                    return None
                return _unpack_stats(state, self._features)
        except (OSError, KeyError, ValueError):
            return None

    def _rebuild_stats(self, data_files: list[Path]) -> dict[str, _RunningStats]:
        stats = {k: _RunningStats(v["shape"][0]) for k, v in self._features.items()}
        for path in data_files:
            table = pq.read_table(path, columns=list(self._features))
            for name, spec in self._features.items():
                values = _to_numpy(table.column(name), spec["shape"][0])
                if len(values):
                    stats[name] = stats[name].merged(values)
        return stats

    def _write_stats(
        self,
        stats: Mapping[str, _RunningStats],
        num_frames: int,
        stats_json: Mapping[str, Any] | None = None,
    ) -> None:
        if stats_json is None:
            stats_json = {name: s.to_json() for name, s in stats.items()}
        # Compact: json's indenting encoder is pure Python, ten times slower than the C one.
        _write_json(self._root / STATS_PATH, stats_json, indent=None)
        path = self._root / STATS_STATE_PATH
        tmp = _tmp_path(path)
        with open(tmp, "wb") as f:
            np.savez(f, **_pack_stats(stats, num_frames))
        _commit(tmp, path)
