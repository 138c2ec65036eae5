"""The LeRobot ``v3.0`` folder layout, ``info.json`` and the features it declares.

The folder is what LeRobot's ``LeRobotDataset(repo_id, root=folder)`` loads::

    meta/info.json                            format, fps, features, totals: the commit point
    meta/stats.json                           per feature: min max mean std count q01 ... q99
    meta/tasks.parquet                        task_index, and the task as a pandas index "task"
    meta/episodes/chunk-000/file-000.parquet  one row per episode, row i is episode i
    data/chunk-000/file-000.parquet           one row per frame, episodes contiguous

    videos/<feature>/chunk-000/file-000.mp4   video features: episodes one after another

LeRobot finds the data and episodes files with the globs ``data/*/*.parquet`` and
``meta/episodes/*/*.parquet`` (``GLOBS``), and a video through its episode's row
(``videos/<feature>/chunk_index``, ``file_index``, ``from_timestamp``, ``to_timestamp``). Every
data file holds the declared features plus the five LeRobot adds to every frame
(``DEFAULT_FEATURES``). A feature of shape ``[1]`` is a scalar column; a feature of shape ``[D]``
is a ``fixed_size_list<D>`` column. Cameras are features of shape ``[H, W, 3]`` (uint8 RGB
frames) and dtype ``"video"`` (frames in the mp4 files, no data column; ``info`` describes the
stream) or ``"image"`` (a PNG per frame in the data file, in the ``{"bytes", "path"}`` struct
that LeRobot's loader reads as an image column).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
# Our own cache of the running statistics; LeRobot never reads it.
STATS_STATE_PATH = "meta/.jaxtraj-stats.npz"
# The cache as of the commit before, kept for datasets with videos (see stats.stage_files).
STATS_PREVIOUS_PATH = "meta/.jaxtraj-stats-previous.npz"
DATA_GLOB = "data/*/*.parquet"
EPISODES_GLOB = "meta/episodes/*/*.parquet"
GLOBS = (DATA_GLOB, EPISODES_GLOB)
DEFAULT_CHUNKS_SIZE = 1000
DEFAULT_DATA_FILES_SIZE_IN_MB = 100
DEFAULT_VIDEO_FILES_SIZE_IN_MB = 200
# Parquet dictionary encoding for the data files: it pays only on low-cardinality columns; on
# float observations it builds a hash table that overflows and is thrown away, which more than
# doubles the write time.
DICTIONARY_COLUMNS = ["episode_index", "task_index", "frame_index"]

# The columns LeRobot adds to every frame, in the order it appends them to the user's features.
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}

DTYPES = (
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

CAMERA_DTYPES = ("video", "image")
CAMERA_NAMES = ["height", "width", "channels"]
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])

Location = tuple[int, int]
"""A file's ``(chunk_index, file_index)``."""

_FILE_RE = re.compile(r"chunk-(\d+)/file-(\d+)\.(?:parquet|mp4)$")


def is_camera(spec: Mapping[str, Any]) -> bool:
    return spec.get("dtype") in CAMERA_DTYPES


def video_keys(features: Mapping[str, Mapping[str, Any]]) -> list[str]:
    return [name for name, spec in features.items() if spec.get("dtype") == "video"]


def image_keys(features: Mapping[str, Mapping[str, Any]]) -> list[str]:
    return [name for name, spec in features.items() if spec.get("dtype") == "image"]


def column_features(features: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The features stored as data-file columns: every one but the videos."""
    return {name: spec for name, spec in features.items() if spec.get("dtype") != "video"}


def video_path(root: Path, key: str, loc: Location) -> Path:
    return root / VIDEO_PATH.format(video_key=key, chunk_index=loc[0], file_index=loc[1])


def data_path(root: Path, loc: Location) -> Path:
    return root / DATA_PATH.format(chunk_index=loc[0], file_index=loc[1])


def episodes_path(root: Path, loc: Location) -> Path:
    return root / EPISODES_PATH.format(chunk_index=loc[0], file_index=loc[1])


def next_location(loc: Location | None, chunks_size: int) -> Location:
    """The (chunk, file) index after ``loc``: files roll into the next chunk after chunks_size."""
    if loc is None:
        return 0, 0
    chunk, file = loc
    return (chunk + 1, 0) if file + 1 >= chunks_size else (chunk, file + 1)


def location(path: Path) -> Location | None:
    """The (chunk, file) index in a data, episodes or video file's path; None if it has none."""
    match = _FILE_RE.search(path.as_posix())
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def located_files(root: Path, pattern: str) -> list[tuple[Location, Path]]:
    """Files matching a LeRobot glob that follow the chunk/file naming, in (chunk, file) order."""
    found = [(location(p), p) for p in root.glob(pattern)]
    return sorted((loc, p) for loc, p in found if loc is not None)


def read_info(path: Path) -> dict[str, Any]:
    """``meta/info.json`` as a dict; ``ValueError`` unless it is a ``v3.0`` dataset's."""
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


def new_info(
    fps: int,
    features: Mapping[str, Any],
    robot_type: str | None,
    data_files_size_in_mb: float | None,
    chunks_size: int | None,
    video_files_size_in_mb: float | None = None,
) -> dict[str, Any]:
    """``info.json`` of an empty dataset."""
    return {
        "codebase_version": CODEBASE_VERSION,
        "fps": int(fps),
        "features": dict(features),
        "total_episodes": 0,
        "total_frames": 0,
        "total_tasks": 0,
        "chunks_size": chunks_size or DEFAULT_CHUNKS_SIZE,
        "data_files_size_in_mb": data_files_size_in_mb or DEFAULT_DATA_FILES_SIZE_IN_MB,
        "video_files_size_in_mb": video_files_size_in_mb or DEFAULT_VIDEO_FILES_SIZE_IN_MB,
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if video_keys(features) else None,
        "robot_type": robot_type,
        "splits": {"train": "0:0"},
    }


def check_features(features: Any) -> dict[str, dict[str, Any]]:
    """Validate declared features; return them as info.json stores them (shape a list).

    A camera's ``info`` block, if given, is dropped: the writer describes its own videos.
    """
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
        dtype = spec.get("dtype")
        allowed = {"dtype", "shape", "names"} | ({"info"} if dtype in CAMERA_DTYPES else set())
        unknown = set(spec) - allowed
        if unknown:
            raise ValueError(f"feature {name!r}: unknown keys {sorted(unknown)}")
        if dtype in CAMERA_DTYPES:
            out[name] = _check_camera(name, spec)
            continue
        if dtype not in DTYPES:
            raise ValueError(
                f"feature {name!r}: dtype {dtype!r} is not supported (one of"
                f" {', '.join(DTYPES + CAMERA_DTYPES)})"
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


def _check_camera(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A camera feature: ``[H, W, 3]`` uint8 RGB frames (channels last, as collected)."""
    dtype, shape = spec["dtype"], spec.get("shape")
    if (
        not isinstance(shape, Sequence)
        or len(shape) != 3
        or not all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in shape)
        or shape[2] != 3
        or min(shape) < 1
    ):
        raise ValueError(
            f"feature {name!r}: dtype {dtype!r} needs shape [H, W, 3] (uint8 RGB, channels"
            f" last), got {shape!r}"
        )
    # yuv420p needs even sides; SVT-AV1 builds older than PyAV 18's (PyAV 15's, which LeRobot
    # installs) crash (SIGFPE) on frames narrower than 32.
    if dtype == "video" and (shape[0] % 2 or shape[1] % 2 or min(shape[:2]) < 32):
        raise ValueError(
            f"feature {name!r}: dtype 'video' needs an even height and width of at least 32"
            f" (yuv420p, SVT-AV1), got {list(shape)}; store it as dtype 'image'"
        )
    return {"dtype": dtype, "shape": [int(d) for d in shape], "names": list(CAMERA_NAMES)}


def arrow_type(spec: Mapping[str, Any]) -> pa.DataType:
    """A feature's column type: the scalar, or a fixed-size list of ``shape[0]`` scalars."""
    if spec["dtype"] == "image":
        return IMAGE_TYPE
    scalar = pa.from_numpy_dtype(np.dtype(spec["dtype"]))
    width = spec["shape"][0]
    return scalar if width == 1 else pa.list_(scalar, width)


def to_arrow(values: np.ndarray) -> pa.Array:
    """``[n]`` to a scalar column, ``[n, D]`` to a fixed-size list column."""
    if values.ndim == 1:
        return pa.array(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])


def to_numpy(column: pa.ChunkedArray, width: int) -> np.ndarray:
    """A feature column back to ``[n, width]``."""
    array = column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        array = array.flatten()
    return array.to_numpy(zero_copy_only=False).reshape(-1, width)


def tasks_table(tasks: Sequence[str]) -> pa.Table:
    """``meta/tasks.parquet`` as pandas writes a frame indexed by a ``task`` index.

    The pandas metadata makes ``pandas.read_parquet`` restore the index, whose name LeRobot reads
    back as the task string; it is written by hand so that this package does not need pandas.
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
