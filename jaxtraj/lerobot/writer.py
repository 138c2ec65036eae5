"""``LeRobotWriter``: append completed episodes to a LeRobot ``v3.0`` dataset folder.

Append strategy. ``add_episodes`` starts a new data file for every call, and more than one when
the call's frames would pass ``data_files_size_in_mb`` (measured, like LeRobot's aggregation does,
as uncompressed column bytes); an episode is never split, so an episode larger than the limit gets
a file of its own. Committed data files are never rewritten, so a call costs the same whatever the
dataset's size, but files are as large as the calls: give ``add_episodes`` batches of a few MB (a
collector's flush), not single short episodes, or the dataset fills with small files. The episodes
metadata, about 80 bytes per episode, is appended by rewriting its current file until that file
would pass the same size limit or 1 MiB, whichever is smaller (the cap bounds the rewrite); the
next file index rolls into the next chunk after ``chunks_size`` files, for data and metadata alike.

Crash safety. No file is kept open between calls. A call first writes every file it changes
under a hidden temporary name that no LeRobot glob matches (:mod:`jaxtraj.lerobot.files`); all
the encoding, compression and statistics happen there, and a process killed during that phase
leaves the visible dataset exactly as the previous call committed it. Only then are the files
renamed into place, with nothing but renames in between: data files (rows no episode refers to
yet), new tasks, statistics, the episodes metadata, and ``meta/info.json`` last, which is the
commit point. A process killed between two of those renames leaves a tail beyond
``total_frames``/``total_episodes``/``total_tasks`` that a reader can see until the folder is
reopened: ``LeRobotWriter.open`` (or the constructor on an existing folder) checks the folder,
removes that tail and stray temporary files (:mod:`jaxtraj.lerobot.resume`), and numbering
resumes without a gap. One writer per folder at a time.

The statistics update (:mod:`jaxtraj.lerobot.stats`) runs in a helper thread while the parquet
files are written (both release the GIL); the thread ends within the call.

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
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from jaxtraj.lerobot import files, resume, stats
from jaxtraj.lerobot.format import (
    DEFAULT_FEATURES,
    INFO_PATH,
    TASKS_PATH,
    Location,
    arrow_type,
    check_features,
    data_path,
    episodes_path,
    new_info,
    next_location,
    read_info,
    tasks_table,
    to_arrow,
)
from jaxtraj.lerobot.validate import check_episodes

# Dictionary encoding pays only on low-cardinality columns; on float observations it builds a
# hash table that overflows and is thrown away, which more than doubles the write time.
DICTIONARY_COLUMNS = ["episode_index", "task_index", "frame_index"]
# Episodes-metadata row: 8 int64 columns plus the list and string offsets of ``tasks``.
_META_ROW_NBYTES = 8 * 8 + 4 + 4
# Every call rewrites the current episodes-metadata file; capping it (about 11,000 episodes)
# bounds that cost whatever the data file limit.
_META_FILE_MAX_BYTES = 1 << 20


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
        self._user_features = check_features(features)
        self._root = Path(root)
        self._features = {**self._user_features, **DEFAULT_FEATURES}
        self._schema = pa.schema([(k, arrow_type(v)) for k, v in self._features.items()])
        self._frame_nbytes = sum(
            np.dtype(v["dtype"]).itemsize * v["shape"][0] for v in self._features.values()
        )

        info_path = self._root / INFO_PATH
        if info_path.is_file():
            self._info = resume.check_settings(
                info_path, self._features, fps, robot_type, data_files_size_in_mb, chunks_size
            )
            state = resume.resume(self._root, self._info, self._features)
        else:
            resume.check_empty(self._root)
            self._info = new_info(
                fps, self._features, robot_type, data_files_size_in_mb, chunks_size
            )
            state = resume.Committed([], None, None, None, stats.empty(self._features))
            files.write_json(info_path, self._info)
        self._tasks: list[str] = state.tasks
        self._task_index = {task: i for i, task in enumerate(self._tasks)}
        self._data_loc: Location | None = state.data_loc
        self._meta_loc: Location | None = state.meta_loc
        self._meta_table: pa.Table | None = state.meta_table
        self._meta_nbytes = 0 if state.meta_table is None else state.meta_table.nbytes
        self._stats = state.stats

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> LeRobotWriter:
        """Resume appending to the dataset at ``root`` with the settings in its ``info.json``.

        Args:
            root: A dataset folder this writer (or LeRobot, for numeric features) created.

        Returns:
            A writer whose next episode is ``total_episodes`` and next frame ``total_frames``.

        Raises:
            ValueError: the folder is not a consistent dataset; the message names the file.
        """
        info = read_info(Path(root) / INFO_PATH)
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

        All input is checked before anything is written (see
        :func:`jaxtraj.lerobot.validate.check_episodes`). A call that raises leaves the dataset
        as it was and can be retried.

        Args:
            episodes: One dict per episode: every declared feature -> array ``[L]`` or
                ``[L, 1]`` for shape ``[1]``, ``[L, D]`` for shape ``[D]``, with one ``L >= 1``
                per episode. JAX arrays are fine (they are copied to the host).
            tasks: One non-empty task string per episode.

        Returns:
            The episode indices assigned, ``range(num_episodes_before, num_episodes_after)``.
        """
        columns, lengths = check_episodes(self._user_features, episodes, tasks)
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
            [to_arrow(columns[name]) for name in self._schema.names], schema=self._schema
        )
        info = dict(self._info)
        info["total_episodes"] = first_episode + len(lengths)
        info["total_frames"] = first_frame + num_frames
        info["total_tasks"] = len(all_tasks)
        info["splits"] = {"train": f"0:{info['total_episodes']}"}

        data: list[files.Staged] = []
        metadata: list[files.Staged] = []
        other: list[files.Staged] = []  # tasks, statistics, info.json
        try:
            # The statistics update (numpy, mostly without the GIL) runs beside the parquet
            # writes (C++, without the GIL): on two cores that hides most of its cost.
            result: dict[str, Any] = {}
            worker = threading.Thread(
                target=self._merge_stats, args=(columns, num_frames, result), daemon=True
            )
            worker.start()
            try:
                data_loc, episode_locs = self._stage_data(data, table, lengths_np)
                meta_loc, meta_table, meta_nbytes = self._stage_metadata(
                    metadata, tasks, lengths_np, episode_locs, first_episode, first_frame
                )
                if len(all_tasks) > len(self._tasks):
                    path = self._root / TASKS_PATH
                    other.append(files.stage_table(path, tasks_table(all_tasks)))
            finally:
                worker.join()
            if "error" in result:
                raise result["error"]
            other += stats.stage_files(
                self._root, result["stats"], info["total_frames"], result["json"]
            )
            other.append(files.stage_json(self._root / INFO_PATH, info))
            # Renames only from here on. The episodes metadata, the rows LeRobot indexes, goes
            # right before info.json, which commits the call.
            files.publish([*data, *other[:-1], *metadata, other[-1]])
        except Exception:
            files.discard([*data, *metadata, *other])
            raise

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
            merged = {
                name: self._stats[name].merged(columns[name].reshape(num_frames, -1))
                for name in self._features
            }
            result["json"] = {name: s.to_json() for name, s in merged.items()}
            result["stats"] = merged
        except BaseException as err:  # re-raised by the caller's thread
            result["error"] = err

    def _stage_data(
        self, staged: list[files.Staged], table: pa.Table, lengths_np: np.ndarray
    ) -> tuple[Location, list[Location]]:
        """Stage the call's data files: greedy, whole episodes, a new file before the limit.

        Args:
            staged: Receives each staged file as it is written.
            table: The call's frames, every column.
            lengths_np: ``[E]`` the call's episode lengths.

        Returns:
            The last data file's location, and each episode's.
        """
        limit = float(self._info["data_files_size_in_mb"]) * (1 << 20)
        lengths = lengths_np.tolist()
        ends = np.cumsum(lengths_np)
        starts = ends - lengths_np
        data_loc = self._data_loc
        episode_locs: list[Location] = []
        group_start = 0
        for i in range(len(lengths) + 1):
            frames = int(ends[i - 1] - starts[group_start]) if i > group_start else 0
            if i < len(lengths) and (
                i == group_start or (frames + lengths[i]) * self._frame_nbytes <= limit
            ):
                continue
            data_loc = next_location(data_loc, self._info["chunks_size"])
            episode_locs += [data_loc] * (i - group_start)
            part = table.slice(int(starts[group_start]), frames)
            staged.append(
                files.stage_table(
                    data_path(self._root, data_loc),
                    part,
                    compression="snappy",
                    use_dictionary=DICTIONARY_COLUMNS,
                )
            )
            group_start = i
        return data_loc, episode_locs

    def _stage_metadata(
        self,
        staged: list[files.Staged],
        tasks: Sequence[str],
        lengths_np: np.ndarray,
        episode_locs: list[Location],
        first_episode: int,
        first_frame: int,
    ) -> tuple[Location, pa.Table | None, int]:
        """Stage the episodes-metadata files that gain rows: row i is episode i.

        The current file is rewritten with the new rows appended until it would pass its size
        limit; the rest go to new files.

        Returns:
            The current episodes-metadata file's location, content and estimated size.
        """
        limit = float(self._info["data_files_size_in_mb"]) * (1 << 20)
        chunks_size = self._info["chunks_size"]
        ends = np.cumsum(lengths_np)
        starts = ends - lengths_np
        meta_loc, meta_table, meta_nbytes = self._meta_loc, self._meta_table, self._meta_nbytes
        meta_limit = min(limit, _META_FILE_MAX_BYTES)
        if meta_loc is None:
            meta_loc = next_location(None, chunks_size)
        pending: list[int] = []
        meta_locs: list[Location] = []
        to_write: list[tuple[Location, pa.Table | None, list[int]]] = []
        for i, task in enumerate(tasks):
            row_nbytes = _META_ROW_NBYTES + len(task.encode())
            if (meta_table is not None or pending) and meta_nbytes + row_nbytes > meta_limit:
                to_write.append((meta_loc, meta_table, pending))
                meta_loc, meta_table, meta_nbytes, pending = (
                    next_location(meta_loc, chunks_size),
                    None,
                    0,
                    [],
                )
            pending.append(i)
            meta_locs.append(meta_loc)
            meta_nbytes += row_nbytes
        to_write.append((meta_loc, meta_table, pending))
        rows = {
            "episode_index": pa.array(np.arange(first_episode, first_episode + len(lengths_np))),
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
            path = episodes_path(self._root, loc)
            staged.append(files.stage_table(path, meta_table, compression="snappy"))
        return meta_loc, meta_table, meta_nbytes
