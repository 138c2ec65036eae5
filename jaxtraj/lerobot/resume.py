"""Opening an existing dataset folder: check it, load its committed state, drop what is not.

A folder is consistent when ``info.json``'s totals match the episodes metadata, every file that
metadata refers to exists with a readable parquet footer and the rows it claims (a video file:
a readable mp4 with at least the frames its episodes' ``to_timestamp`` reach), and the tasks
file holds at least ``total_tasks`` tasks. A writer killed while publishing a call may have left
files past those totals (new data and video files, trailing episodes rows, new tasks, rows at
the end of the last data file and frames at the end of a camera's last video file, which a call
appends to) and staged temporary files (partly encoded videos among them); ``resume`` removes
them (the last data and video files are written again without their tail, under a hidden name
renamed over them), so numbering continues without a gap. Everything is read and
checked first; files change only once the whole folder is known to be consistent, so a folder
that is not raises ``ValueError``, naming the offending file, and is left untouched.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxtraj.lerobot import files, stats
from jaxtraj.lerobot.format import (
    DATA_GLOB,
    DATA_PATH,
    DICTIONARY_COLUMNS,
    EPISODES_GLOB,
    STATS_PATH,
    STATS_PREVIOUS_PATH,
    STATS_STATE_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    Location,
    data_path,
    episodes_path,
    located_files,
    next_location,
    read_info,
    tasks_table,
    video_keys,
    video_path,
)
from jaxtraj.lerobot.video import decode, remux
from jaxtraj.lerobot.video import num_frames as video_frames

# The episodes-metadata columns the writer needs to continue a dataset.
_NEEDED = (
    "episode_index",
    "length",
    "data/chunk_index",
    "data/file_index",
    "dataset_from_index",
    "dataset_to_index",
)


@dataclass
class Committed:
    """What a writer needs to continue a dataset: its committed state, as of ``info.json``.

    Attributes:
        tasks: Task strings in ``task_index`` order.
        data_loc: The last data file's location; None before the first episode.
        meta_loc: The last episodes-metadata file's location; None before the first episode.
        meta_table: That file's rows.
        stats: Every feature's running statistics over the committed frames.
        video_locs: Per video feature, its last video file's location.
        video_frames: Per video feature, the committed frames of that file.
    """

    tasks: list[str]
    data_loc: Location | None
    meta_loc: Location | None
    meta_table: pa.Table | None
    stats: dict[str, stats.Stats]
    video_locs: dict[str, Location]
    video_frames: dict[str, int]


def check_empty(root: Path) -> None:
    """Refuse to create a dataset in a folder that holds anything but a killed creation's debris."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root} exists and is not a folder")
    if root.is_dir():
        # Temporary files and empty folders are what a writer killed at creation leaves.
        stray = [p for p in root.rglob("*") if p.is_file() and not files.is_tmp(p)]
        if stray:
            raise ValueError(
                f"{root} is not empty and has no meta/info.json (found"
                f" {stray[0].relative_to(root)}); refusing to write a dataset into it"
            )


def check_settings(
    path: Path,
    features: Mapping[str, Any],
    fps: int,
    robot_type: str | None,
    data_files_size_in_mb: float | None,
    chunks_size: int | None,
    video_files_size_in_mb: float | None = None,
) -> dict[str, Any]:
    """Read ``info.json`` at ``path``; ``ValueError`` unless it matches the writer's settings.

    The file sizes and ``chunks_size`` are checked only when given (not None).
    """
    info = read_info(path)
    theirs = info.get("features")
    if not isinstance(theirs, dict):
        raise ValueError(f"{path}: features is not an object")
    if theirs != features:
        missing = sorted(set(features) - set(theirs))
        extra = sorted(set(theirs) - set(features))
        changed = sorted(k for k in set(theirs) & set(features) if theirs[k] != features[k])
        raise ValueError(
            f"{path}: features differ from the dataset's: not in the dataset {missing},"
            f" only in the dataset {extra}, different spec {changed}"
        )
    expected = {
        "fps": fps,
        "robot_type": robot_type,
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if video_keys(features) else None,
    }
    if video_files_size_in_mb is not None:
        expected["video_files_size_in_mb"] = video_files_size_in_mb
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


def _read_table(path: Path, what: str) -> pa.Table:
    try:
        return pq.read_table(path)
    except (OSError, ValueError) as err:  # pyarrow's errors derive from these
        raise ValueError(f"{path}: unreadable {what} ({err})") from None


def resume(root: Path, info: Mapping[str, Any], features: Mapping[str, Any]) -> Committed:
    """Check the dataset at ``root`` against ``info``, drop its uncommitted tail, load its state.

    Args:
        root: The dataset folder.
        info: Its ``info.json``, already checked by ``check_settings``.
        features: Every per-frame feature, bookkeeping columns included.

    Returns:
        The committed state. The statistics cache and ``stats.json`` are rewritten from the data
        files when they are missing, damaged or stale.
    """
    num_episodes, num_frames, num_tasks = (
        info["total_episodes"],
        info["total_frames"],
        info["total_tasks"],
    )
    remove = [
        tmp
        for pattern in (
            "meta/.*",
            "meta/episodes/*/.*",
            "data/*/.*",
            "videos/*/.*",
            "videos/*/*/.*",
        )
        for tmp in root.glob(pattern + files.TMP_MARK + "*")
    ]
    rewrite: list[tuple[Path, pa.Table, dict[str, Any]]] = []

    # Episodes metadata: rows below total_episodes are committed, and come first, in files at
    # consecutive locations.
    committed: list[pa.Table] = []
    meta_loc, meta_table = None, None
    for loc, path in located_files(root, EPISODES_GLOB):
        table = _read_table(path, "episodes metadata")
        if "episode_index" not in table.column_names:
            raise ValueError(f"{path}: no episode_index column")
        keep = int(np.sum(table.column("episode_index").to_numpy() < num_episodes))
        if keep == 0:
            remove.append(path)
            continue
        expected = next_location(meta_loc, info["chunks_size"])
        if loc != expected:
            raise ValueError(f"{episodes_path(root, expected)}: missing episodes metadata file")
        if keep < table.num_rows:
            table = table.slice(0, keep)
            rewrite.append((path, table, {"compression": "snappy"}))
        committed.append(table)
        meta_loc, meta_table = loc, table
    videos = video_keys(features)
    needed = list(_NEEDED) + [
        f"videos/{key}/{c}"
        for key in videos
        for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
    ]
    cols = {c: np.zeros(0, dtype=np.int64) for c in needed}
    if committed:
        episodes = pa.concat_tables(committed, promote_options="default")
        missing = [c for c in needed if c not in episodes.column_names]
        if missing:
            raise ValueError(f"{root}: episodes metadata lacks columns {missing}")
        cols = {c: episodes.column(c).to_numpy() for c in needed}
    if len(cols["episode_index"]) < num_episodes:
        after = episodes_path(root, next_location(meta_loc, info["chunks_size"]))
        raise ValueError(
            f"{root}: episodes {len(cols['episode_index'])} to {num_episodes - 1} are in no"
            f" episodes metadata file ({after.relative_to(root)} missing?)"
        )
    if (
        not np.array_equal(cols["episode_index"], np.arange(num_episodes))
        or int(cols["length"].sum()) != num_frames
        or (num_episodes and int(cols["dataset_to_index"][-1]) != num_frames)
    ):
        raise ValueError(
            f"{root}: episodes metadata does not match info.json"
            f" ({num_episodes} episodes, {num_frames} frames)"
        )

    # Data files: every one the committed episodes name must exist, have a readable footer and
    # hold exactly their rows; files past the last are the uncommitted tail.
    locs = list(zip(cols["data/chunk_index"].tolist(), cols["data/file_index"].tolist()))
    if locs != sorted(locs):
        raise ValueError(f"{root}: episodes metadata lists data files out of order")
    rows: dict[Location, int] = {}
    for loc, length in zip(locs, cols["length"].tolist()):
        rows[loc] = rows.get(loc, 0) + length
    data_files: list[Path] = []
    truncate_data: list[tuple[int, Path, pa.Table]] = []
    for loc, expected_rows in rows.items():
        path = data_path(root, loc)
        if not path.is_file():
            raise ValueError(f"{path}: missing data file (the episodes metadata refers to it)")
        try:
            found_rows = pq.ParquetFile(path).metadata.num_rows
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: damaged data file ({err})") from None
        if found_rows > expected_rows and loc == locs[-1]:
            # The last file gained the next call's rows before its info.json: drop them.
            table = _read_table(path, "data file")
            tail = table.column("episode_index").to_numpy()[expected_rows:]
            if (tail >= num_episodes).all():
                truncate_data.append((len(data_files), path, table.slice(0, expected_rows)))
                found_rows = expected_rows
        if found_rows != expected_rows:
            raise ValueError(
                f"{path}: holds {found_rows} rows, the episodes metadata says {expected_rows}"
            )
        data_files.append(path)
    last = locs[-1] if locs else None
    for loc, path in located_files(root, DATA_GLOB):
        if last is None or loc > last:
            remove.append(path)
        elif loc not in rows:
            raise ValueError(f"{path}: a data file that no episode refers to")

    # Video files: likewise per camera, every file a committed episode names must hold the
    # frames its rows reach; files past the last are the uncommitted tail.
    video_locs: dict[str, Location] = {}
    video_ends: dict[str, int] = {}
    truncate: list[tuple[Path, int]] = []
    video_files: dict[str, list[tuple[Path, list[tuple[int, int]]]]] = {}
    fps = info["fps"]
    for key in videos:
        prefix = f"videos/{key}/"
        vlocs = list(
            zip(cols[prefix + "chunk_index"].tolist(), cols[prefix + "file_index"].tolist())
        )
        if vlocs != sorted(vlocs):
            raise ValueError(f"{root}: episodes metadata lists {key} videos out of order")
        spans: dict[Location, list[tuple[int, int]]] = {}
        for loc, start, end in zip(
            vlocs, cols[prefix + "from_timestamp"].tolist(), cols[prefix + "to_timestamp"].tolist()
        ):
            spans.setdefault(loc, []).append((round(start * fps), round(end * fps)))
        video_files[key] = []
        for loc, ranges in spans.items():
            path = video_path(root, key, loc)
            if not path.is_file():
                raise ValueError(f"{path}: missing video file (the episodes metadata refers to it)")
            try:
                found = video_frames(path)
            except Exception as err:  # PyAV raises its own error types
                raise ValueError(f"{path}: damaged video file ({err})") from None
            if found < max(end for _, end in ranges):
                raise ValueError(
                    f"{path}: holds {found} frames, the episodes metadata reaches"
                    f" {max(end for _, end in ranges)}"
                )
            video_files[key].append((path, ranges))
            end = max(end for _, end in ranges)
            if loc == vlocs[-1]:
                video_ends[key] = end
                if found > end:  # the next call's frames, appended before its info.json
                    truncate.append((path, end))
        if vlocs:
            video_locs[key] = vlocs[-1]
        for loc, path in located_files(root, f"videos/{glob.escape(key)}/*/*.mp4"):
            if key not in video_locs or loc > video_locs[key]:
                remove.append(path)
            elif loc not in spans:
                raise ValueError(f"{path}: a video file that no episode refers to")

    def video_episodes(key: str):
        for path, ranges in video_files[key]:
            frames = decode(path)
            for start, end in ranges:
                yield frames[start:end]

    # Tasks: appended in task_index order, so the committed ones are a prefix.
    path = root / TASKS_PATH
    tasks: list[str] = []
    if not num_tasks and path.is_file():
        remove.append(path)
    elif num_tasks:
        table = _read_table(path, "tasks file") if path.is_file() else None
        name = next(
            (c for c in ("task", "__index_level_0__") if table and c in table.column_names),
            None,
        )
        if table is None or name is None or table.num_rows < num_tasks:
            raise ValueError(f"{path}: missing, or fewer than {num_tasks} tasks")
        order = np.argsort(table.column("task_index").to_numpy(), kind="stable")
        tasks = [table.column(name)[int(i)].as_py() for i in order[:num_tasks]]
        if table.num_rows > num_tasks:
            rewrite.append((path, tasks_table(tasks), {}))

    # Consistent. The last data file without its tail is staged now, under its hidden name:
    # the statistics are rebuilt from it if need be; it is renamed over the file below.
    staged: list[files.Staged] = []
    for i, path, table in truncate_data:
        staged.append(
            files.stage_table(path, table, compression="snappy", use_dictionary=DICTIONARY_COLUMNS)
        )
        data_files[i] = staged[-1][0]
    try:
        running = _statistics(root, features, num_frames, data_files, video_episodes)
    except BaseException:
        files.discard(staged)
        raise
    running, stale = running
    if not num_frames:
        remove += [
            p
            for p in (root / STATS_PATH, root / STATS_STATE_PATH, root / STATS_PREVIOUS_PATH)
            if p.is_file()
        ]

    # Now drop the uncommitted tail.
    files.publish(staged)
    for path, table, options in rewrite:
        files.write_table(path, table, **options)
    for path, end in truncate:
        import av

        tmp = files.tmp_path(path)
        remux(av, path, end, None, tmp, fps)
        files.publish([(tmp, path)])
    for path in remove:
        path.unlink(missing_ok=True)  # a stray temporary may share a name staged above
    if num_frames and stale:
        files.publish(stats.stage_files(root, running, num_frames))
    return Committed(tasks, last, meta_loc, meta_table, running, video_locs, video_ends)


def _statistics(root, features, num_frames, data_files, video_episodes):
    """The cached statistics if sound and of ``num_frames`` frames, else a rescan; and whether
    ``stats.json`` needs writing again."""
    running = stats.load_state(root / STATS_STATE_PATH, features, num_frames)
    if running is None:
        running = stats.load_state(root / STATS_PREVIOUS_PATH, features, num_frames)
    stale = running is None
    if running is None:
        running = stats.rebuild(data_files, features, video_episodes)
    else:
        try:
            saved = json.loads((root / STATS_PATH).read_text())
            stale = saved["index"]["count"] != [num_frames]
        except (OSError, ValueError, KeyError, TypeError):
            stale = True
    return running, stale
