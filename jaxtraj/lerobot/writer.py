"""``LeRobotWriter``: append completed episodes to a LeRobot ``v3.0`` dataset folder.

Append strategy. Episodes follow each other in the current data file across calls until the next
episode would take it past ``data_files_size_in_mb`` (measured, like LeRobot's aggregation does,
as uncompressed column bytes); then a new file starts. An episode is never split, so an episode
larger than the limit gets a file of its own. A call appends by writing the current file again,
its rows followed by the call's, under a hidden name, renamed over it at the commit: a call costs
a read and a write of the current file, up to the cap (about 1.6 s a call near a 100 MB cap on
the loaded 2-core VM; with cameras in the committer thread, off the caller's path). Each camera's
current video file likewise goes on across calls (:func:`jaxtraj.lerobot.video.append`: its
packets and the call's remuxed, not re-encoded, into a new hidden file) while the combined file
stays within ``video_files_size_in_mb``. The episodes metadata, about 80 bytes per episode, is
appended by rewriting its current file until that file would pass the same size limit or 1 MiB,
whichever is smaller (the cap bounds the rewrite); the next file index rolls into the next chunk
after ``chunks_size`` files, for data, metadata and videos alike.

Crash safety. No file is kept open between calls. A call first writes every file it changes
under a hidden temporary name that no LeRobot glob matches (:mod:`jaxtraj.lerobot.files`); all
the encoding, compression and statistics happen there, and a process killed during that phase
leaves the visible dataset exactly as the previous call committed it. Only then are the files
renamed into place, with nothing but renames in between: data files (rows no episode refers to
yet; a rewritten current file keeps its committed rows first, unchanged), new tasks,
statistics, the episodes metadata, and ``meta/info.json`` last, which is the commit point. A
process killed between two of those renames leaves a tail beyond
``total_frames``/``total_episodes``/``total_tasks`` (new files, or rows and frames at the end of
the current data and video files) that a reader can see until the folder is reopened:
``LeRobotWriter.open`` (or the constructor on an existing folder) checks the folder, removes
that tail and stray temporary files (:mod:`jaxtraj.lerobot.resume`), and numbering resumes
without a gap. One writer per folder at a time.

The statistics update (:mod:`jaxtraj.lerobot.stats`) runs in a helper thread while the parquet
files are written (both release the GIL); the thread ends within the call.

Cameras. A dataset with camera features (``"video"`` or ``"image"``, shape ``[H, W, 3]``) is
written in the background, off the caller's path: ``add_episodes`` checks and copies the
episodes, hands each camera's frames to a pool of encoder threads (PyAV and zlib release the
GIL; video encodes run one at a time in a supervised encoder process, see
:mod:`jaxtraj.lerobot.video`), queues the call for a committer thread and returns the episode
indices it assigned. The committer commits calls in order, each as above once its encodes are
done; a call's video files (one or more per
camera) are encoded under hidden temporary names; the first joins the camera's current file (the
committer has the encoder process remux both into a new hidden file) and all are renamed into
place with its data files, before the metadata that refers to them, so no committed metadata
ever names a partly written mp4.
Memory is bounded: while the frames of uncommitted calls pass ``max_pending_mb``,
``add_episodes`` blocks; nothing is dropped. ``wait()`` returns once everything accepted is
committed; ``close()`` waits and stops the threads; the encoder process is ended, or kept
idle a few seconds for the next writer (:func:`jaxtraj.lerobot.video.give_back`). A video encode
that gives no answer within ``encode_timeout_s`` has its process killed, its partial files
deleted, and is sent again to a fresh process, up to ``encode_retries`` times. An encode that
fails every attempt, or a write error, stops the writer: that call and the later ones are not
committed (the folder stays as the last commit left it), and ``add_episodes``, ``wait`` and
``close`` raise ``LeRobotWriteError`` naming the episodes, the camera feature and why each
attempt failed (for an encoder error, the episode being encoded).

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

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq

from jaxtraj.lerobot import files, images, resume, stats, video
from jaxtraj.lerobot.format import (
    DEFAULT_FEATURES,
    DEFAULT_VIDEO_FILES_SIZE_IN_MB,
    DICTIONARY_COLUMNS,
    INFO_PATH,
    TASKS_PATH,
    Location,
    arrow_type,
    check_features,
    column_features,
    data_path,
    episodes_path,
    new_info,
    next_location,
    read_info,
    tasks_table,
    to_arrow,
    video_keys,
    video_path,
)
from jaxtraj.lerobot.validate import check_episodes

_log = logging.getLogger(__name__)


def _warn_constant_cameras(cameras: Mapping[str, Sequence[np.ndarray]], first: int) -> None:
    """Log a warning naming each camera feature whose frames do not change over an episode
    of two or more frames (a camera rendered black in a thread without the simulator's
    rendering context, a blank placeholder): such a feature is useless to train on and
    nothing else would say so."""
    for name, arrays in cameras.items():
        flat = [first + i for i, a in enumerate(arrays)
                if len(a) > 1 and not np.any(a != a[:1])]
        if flat:
            shown = ", ".join(map(str, flat[:8])) + (", ..." if len(flat) > 8 else "")
            value = int(np.asarray(arrays[flat[0] - first]).reshape(-1)[0])
            _log.warning(
                "camera feature %r is constant over episode(s) %s (every pixel %d in episode "
                "%d): was it rendered? (a MuJoCo camera renders zeros in a thread without its "
                "OpenGL context: build the env in the thread that steps it)",
                name, shown, value, flat[0])

# Episodes-metadata row: 8 int64 columns plus the list and string offsets of ``tasks``.
_META_ROW_NBYTES = 8 * 8 + 4 + 4
# Every call rewrites the current episodes-metadata file; capping it (about 11,000 episodes)
# bounds that cost whatever the data file limit.
_META_FILE_MAX_BYTES = 1 << 20


class LeRobotWriteError(RuntimeError):
    """A background encode or commit failed; the episodes it names were not written."""


@dataclass(eq=False)
class _Call:
    """One ``add_episodes`` call on its way to the folder."""

    first_episode: int
    first_frame: int
    columns: dict[str, np.ndarray]
    cameras: dict[str, list[np.ndarray]]
    lengths: list[int]
    tasks: list[str]
    nbytes: int = 0
    encodes: dict[str, Future] = field(default_factory=dict)
    # The first of its encodes to fail for good: the others need not run, and report it.
    failure: RuntimeError | None = None

    def describe(self) -> str:
        last = self.first_episode + len(self.lengths) - 1
        return f"episodes {self.first_episode} to {last}"


class LeRobotWriter:
    """Appends completed episodes to a LeRobot ``v3.0`` dataset folder, one call at a time.

    Creates the dataset when ``root`` is missing or empty; resumes it when ``root`` holds a
    dataset with the same fps, robot type and features (and, where given, the same file sizes
    and video settings), after removing what a killed writer left uncommitted. Anything else
    raises ``ValueError`` before a byte is written.

    Args:
        root: The dataset folder.
        fps: Frames per second, a positive int; ``timestamp = frame_index / fps``.
        features: The per-frame features besides LeRobot's five bookkeeping columns, name ->
            ``{"dtype": "float32", "shape": [D], "names": None}``. dtype is a numpy bool, int,
            uint or float name (not float16); shape ``[1]`` is a scalar column; ``names`` is
            null, D strings, or a dict as LeRobot allows. Names may not contain ``/``. A camera
            is ``{"dtype": "video" or "image", "shape": [H, W, 3]}`` (uint8 RGB frames; a
            video needs an even H and W); the writer fills its ``names`` and ``info``.
        robot_type: Stored in ``info.json``; may be None.
        data_files_size_in_mb: Size limit of a data (and episodes-metadata) file, in MiB of
            uncompressed column data; default 100, or the dataset's own when resuming.
        chunks_size: Files per chunk folder; default 1000, or the dataset's own when resuming.
        video_files_size_in_mb: A video file is closed once it passes this size; default 200.
        video_codec: ``"libsvtav1"`` (LeRobot's default) or ``"h264"``.
        crf: Video quality, LeRobot's default 30.
        gop: Keyframe interval in frames, LeRobot's default 2.
        preset: Encoder preset; None is SVT-AV1's 12 (LeRobot's) or libx264's default.
        encoder_workers: Encoder threads; default the number of CPUs, at most 8.
        encoder_threads: Threads of each encoder (SVT-AV1 ``lp``, libx264 ``threads``); None
            lets the codec decide, as LeRobot does. 1 leaves the most CPU to collection.
        max_pending_mb: Camera frames (MiB, raw) accepted but not yet committed before
            ``add_episodes`` blocks; default 512. A larger single call is still accepted alone.
        encode_timeout_s: The watchdog of one attempt at encoding one call's frames of one video
            camera, in seconds; None (default) scales with the job: 10 ms a frame (in
            proportion above 100,000 pixels a frame), at least 60 s
            (:func:`jaxtraj.lerobot.video.default_timeout`). On expiry the encoder process is
            killed and the attempt fails.
        encode_retries: Attempts after a failed one (timed out, encoder process died, encoder
            error), each from the frames again in a fresh process; default 2.
        only_successful: Write only the episodes whose ``next.success`` is set at some
            frame (the others are dropped and counted in :attr:`num_dropped`); needs the
            ``next.success`` feature. The episodes table records ``success`` per episode
            whenever the feature exists.

    Example::

        writer = LeRobotWriter(root, fps=10, features={
            "observation.state": {"dtype": "float32", "shape": [4], "names": None},
            "observation.images.top": {"dtype": "video", "shape": [96, 96, 3]}})
        writer.add_episodes([{"observation.state": np.zeros((50, 4), np.float32),
                              "observation.images.top": np.zeros((50, 96, 96, 3), np.uint8)}],
                            ["reach"])
        writer.close()       # waits for the encoders, then every accepted episode is committed
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
        video_files_size_in_mb: float | None = None,
        video_codec: str = "libsvtav1",
        crf: int = 30,
        gop: int = 2,
        preset: int | str | None = None,
        encoder_workers: int | None = None,
        encoder_threads: int | None = None,
        max_pending_mb: float = 512,
        encode_timeout_s: float | None = None,
        encode_retries: int = 2,
        only_successful: bool = False,
    ):
        if not isinstance(fps, int | np.integer) or isinstance(fps, bool) or fps <= 0:
            raise ValueError(f"fps must be a positive int, got {fps!r}")
        if robot_type is not None and not isinstance(robot_type, str):
            raise ValueError(f"robot_type must be a string or None, got {robot_type!r}")
        for name, size in (
            ("data_files_size_in_mb", data_files_size_in_mb),
            ("video_files_size_in_mb", video_files_size_in_mb),
        ):
            if size is not None and (
                isinstance(size, bool) or not isinstance(size, int | float) or not size > 0
            ):
                raise ValueError(f"{name} must be > 0, got {size!r}")
        if chunks_size is not None and (
            isinstance(chunks_size, bool) or not isinstance(chunks_size, int) or chunks_size < 1
        ):
            raise ValueError(f"chunks_size must be a positive int, got {chunks_size!r}")
        if encoder_workers is not None and (
            isinstance(encoder_workers, bool)
            or not isinstance(encoder_workers, int)
            or encoder_workers < 1
        ):
            raise ValueError(f"encoder_workers must be a positive int, got {encoder_workers!r}")
        if isinstance(max_pending_mb, bool) or not isinstance(max_pending_mb, int | float):
            raise ValueError(f"max_pending_mb must be a number, got {max_pending_mb!r}")
        if encode_timeout_s is not None and (
            isinstance(encode_timeout_s, bool)
            or not isinstance(encode_timeout_s, int | float)
            or not encode_timeout_s > 0
        ):
            raise ValueError(f"encode_timeout_s must be > 0 or None, got {encode_timeout_s!r}")
        if (
            isinstance(encode_retries, bool)
            or not isinstance(encode_retries, int)
            or encode_retries < 0
        ):
            raise ValueError(f"encode_retries must be an int >= 0, got {encode_retries!r}")
        self._video = video.VideoSettings(
            codec=video_codec, crf=crf, g=gop, preset=preset, threads=encoder_threads
        )
        self._user_features = check_features(features)
        if only_successful and "next.success" not in self._user_features:
            raise ValueError(
                "only_successful needs the 'next.success' feature (env halves carrying "
                "EnvTransition.success); the features have none"
            )
        self._only_successful = bool(only_successful)
        #: Episodes not written because they never succeeded (``only_successful``).
        self.num_dropped = 0
        for name in video_keys(self._user_features):
            spec = self._user_features[name]
            spec["info"] = self._video.info(spec["shape"], int(fps))
        self._root = Path(root)
        self._features = {**self._user_features, **DEFAULT_FEATURES}
        self._columns = column_features(self._features)
        self._video_keys = video_keys(self._features)
        self._image_keys = [k for k, v in self._features.items() if v["dtype"] == "image"]
        self._schema = pa.schema([(k, arrow_type(v)) for k, v in self._columns.items()])
        self._frame_nbytes = sum(
            np.dtype(v["dtype"]).itemsize * v["shape"][0]
            for v in self._columns.values()
            if v["dtype"] != "image"
        )

        info_path = self._root / INFO_PATH
        if info_path.is_file():
            self._info = resume.check_settings(
                info_path,
                self._features,
                fps,
                robot_type,
                data_files_size_in_mb,
                chunks_size,
                video_files_size_in_mb,
            )
            state = resume.resume(self._root, self._info, self._features)
        else:
            resume.check_empty(self._root)
            self._info = new_info(
                fps,
                self._features,
                robot_type,
                data_files_size_in_mb,
                chunks_size,
                video_files_size_in_mb,
            )
            state = resume.Committed([], None, None, None, stats.empty(self._features), {}, {})
            files.write_json(info_path, self._info)
        self._tasks: list[str] = state.tasks
        self._task_index = {task: i for i, task in enumerate(self._tasks)}
        self._data_loc: Location | None = state.data_loc
        # The current data file's size as the limit counts it (uncompressed column bytes).
        self._data_nbytes = self._file_nbytes(state.data_loc)
        self._meta_loc: Location | None = state.meta_loc
        self._meta_table: pa.Table | None = state.meta_table
        self._meta_nbytes = 0 if state.meta_table is None else state.meta_table.nbytes
        self._stats = state.stats
        self._video_locs: dict[str, Location | None] = {
            k: state.video_locs.get(k) for k in self._video_keys
        }
        # Committed frames of each camera's current video file.
        self._video_frames: dict[str, int] = {
            k: state.video_frames.get(k, 0) for k in self._video_keys
        }
        #: How often ``add_episodes`` waited for the encoder backlog (``max_pending_mb``), and
        #: for how long in all, in seconds.
        self.blocked_calls = 0
        self.blocked_s = 0.0
        # Background path (cameras only): the caller's counters run ahead of the committed ones.
        self._next_episode = self._info["total_episodes"]
        self._next_frame = self._info["total_frames"]
        self._workers = encoder_workers or min(8, os.cpu_count() or 1)
        self._max_pending = float(max_pending_mb) * (1 << 20)
        self._pool: ThreadPoolExecutor | None = None
        self._encoder: video.EncoderProcess | None = None
        self._encode_timeout = encode_timeout_s
        self._encode_retries = encode_retries
        self._calls: collections.deque[_Call] = collections.deque()
        self._cond = threading.Condition()
        self._committer: threading.Thread | None = None
        self._pending_bytes = 0
        self._error: LeRobotWriteError | None = None
        self._closed = False
        #: Frames of episodes still running in the collector that feeds this writer (its
        #: lerobot mode keeps the count): not written until ``TrajectoryCollector.end()``.
        self.running_frames = 0

    @classmethod
    def open(cls, root: str | os.PathLike[str], **options: Any) -> LeRobotWriter:
        """Resume appending to the dataset at ``root`` with the settings in its ``info.json``.

        Args:
            root: A dataset folder this writer (or LeRobot, for numeric features) created.
            options: ``encoder_workers``, ``encoder_threads``, ``max_pending_mb``,
                ``encode_timeout_s`` and ``encode_retries``.

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
        settings = {}
        for spec in features.values():
            if isinstance(spec, dict) and spec.get("dtype") == "video":
                # A bad block is reported by the feature checks and the settings comparison.
                try:
                    found = video.VideoSettings.from_info(spec.get("info") or {})
                except (ValueError, TypeError):
                    break
                settings = {
                    "video_codec": found.codec,
                    "crf": found.crf,
                    "gop": found.g,
                    "preset": found.preset,
                    "video_files_size_in_mb": info.get("video_files_size_in_mb"),
                }
                break
        return cls(
            root,
            fps=info.get("fps"),
            features=features,
            robot_type=info.get("robot_type"),
            data_files_size_in_mb=info.get("data_files_size_in_mb"),
            chunks_size=info.get("chunks_size"),
            **settings,
            **options,
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
        """Episodes accepted: the next episode's ``episode_index`` (all committed after wait)."""
        return self._next_episode

    @property
    def num_frames(self) -> int:
        """Frames accepted: the next frame's ``index`` (all committed after wait)."""
        return self._next_frame

    @property
    def committed_episodes(self) -> int:
        """Episodes committed to the folder (``info.json``'s ``total_episodes``)."""
        return self._info["total_episodes"]

    @property
    def tasks(self) -> tuple[str, ...]:
        """Task strings in ``task_index`` order (of the committed episodes)."""
        return tuple(self._tasks)

    def add_episodes(self, episodes: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> range:
        """Append completed episodes; commit them with one ``info.json`` rename.

        All input is checked before anything is written (see
        :func:`jaxtraj.lerobot.validate.check_episodes`). Without cameras the call commits
        before it returns, and a call that raises leaves the dataset as it was and can be
        retried. With cameras the call returns once the episodes are queued (blocking while
        ``max_pending_mb`` of frames wait); they are committed in the background, in order.

        Args:
            episodes: One dict per episode: every declared feature -> array ``[L]`` or
                ``[L, 1]`` for shape ``[1]``, ``[L, D]`` for shape ``[D]``, ``[L, H, W, 3]``
                uint8 for a camera, with one ``L >= 1`` per episode. JAX arrays are fine
                (they are copied to the host).
            tasks: One non-empty task string per episode.

        Returns:
            The episode indices assigned, ``range(num_episodes_before, num_episodes_after)``.

        Raises:
            ValueError: bad input (nothing queued).
            LeRobotWriteError: an earlier call failed in the background; the writer is stopped.
        """
        self._check_usable()
        if self._only_successful:
            keep = [np.asarray(ep["next.success"]).any() for ep in episodes]
            if len(keep) == len(tasks):  # else check_episodes names the mismatch
                self.num_dropped += keep.count(False)
                episodes = [ep for ep, k in zip(episodes, keep) if k]
                tasks = [t for t, k in zip(tasks, keep) if k]
        columns, cameras, lengths = check_episodes(self._user_features, episodes, tasks)
        first_episode, first_frame = self._next_episode, self._next_frame
        if not lengths:
            return range(first_episode, first_episode)
        _warn_constant_cameras(cameras, first_episode)
        call = _Call(first_episode, first_frame, columns, cameras, lengths, list(tasks))
        if not cameras:
            self._commit(call)
            self._next_episode = self._info["total_episodes"]
            self._next_frame = self._info["total_frames"]
            return range(first_episode, self._next_episode)

        call.nbytes = sum(a.nbytes for arrays in cameras.values() for a in arrays)
        with self._cond:
            blocked_at = None
            while (
                self._error is None
                and self._pending_bytes
                and self._pending_bytes + call.nbytes > self._max_pending
            ):
                if blocked_at is None:
                    blocked_at = time.perf_counter()
                self._cond.wait()
            if blocked_at is not None:
                self.blocked_calls += 1
                self.blocked_s += time.perf_counter() - blocked_at
            self._check_usable()
            self._pending_bytes += call.nbytes
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="lerobot-encode")
        if self._encoder is None and self._video_keys:
            self._encoder = video.take_encoder()
        for key in self._video_keys:
            call.encodes[key] = self._pool.submit(self._encode_video, call, key)
        for key in self._image_keys:
            call.encodes[key] = self._pool.submit(images.encode_episodes, cameras[key])
        self._next_episode += len(lengths)
        self._next_frame += sum(lengths)
        with self._cond:
            self._calls.append(call)
            if self._committer is None:
                # Not a daemon: an interpreter exiting without close() still commits what
                # was accepted before it ends.
                self._committer = threading.Thread(
                    target=self._run_committer, name="lerobot-commit"
                )
                self._committer.start()
        return range(first_episode, self._next_episode)

    def wait(self) -> None:
        """Block until every accepted episode is committed.

        Raises:
            LeRobotWriteError: a background encode or commit failed (naming the episodes).
        """
        with self._cond:
            while self._committer is not None:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """Wait for every accepted episode, then stop the encoder threads; idempotent.

        Episodes still running in the collector that feeds this writer (lerobot mode
        counts their frames in :attr:`running_frames`) are not written by ``close``: call
        ``TrajectoryCollector.end()`` first to write them as truncated. Closing with
        frames left logs a warning naming how many; a checkpoint of the collector
        (``jaxtraj.checkpoint.save``) keeps them for a resumed recording.

        Raises:
            LeRobotWriteError: as ``wait``; the threads are stopped all the same.
        """
        if self.running_frames and not self._closed:
            _log.warning(
                "%s: closed with %d frames of running episodes not written; call "
                "TrajectoryCollector.end() before close() to write them as truncated "
                "episodes, or checkpoint the collector to resume them",
                self._root,
                self.running_frames,
            )
        try:
            self.wait()
        finally:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._encoder is not None:
                video.give_back(self._encoder)
                self._encoder = None

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ValueError(f"{self._root}: the writer is closed")

    def _encode_video(self, call: _Call, key: str) -> tuple[list[Path], list[video.Placed]]:
        """Pool task: one camera's frames of one call, into hidden temporary mp4 files."""
        folder = self._root / "videos" / key
        folder.mkdir(parents=True, exist_ok=True)
        limit = float(self._info.get("video_files_size_in_mb") or DEFAULT_VIDEO_FILES_SIZE_IN_MB)
        try:
            return video.encode(
                lambda part: files.tmp_path(folder / f"call-{call.first_episode}-{part}.mp4"),
                call.cameras[key],
                self._info["fps"],
                self._video,
                limit * (1 << 20),
                call.first_episode,
                encoder=self._encoder,
                timeout_s=self._encode_timeout,
                retries=self._encode_retries,
                # A call with a failed camera, or a stopped writer, commits nothing more.
                cancelled=lambda: call.failure is not None or self._error is not None,
            )
        except RuntimeError as err:
            if call.failure is None:
                call.failure = RuntimeError(f"feature {key!r}, {err}")
                call.failure.__cause__ = err
            raise call.failure from call.failure.__cause__

    def _run_committer(self) -> None:
        """Committer thread: commit queued calls in order until none is left."""
        while True:
            with self._cond:
                if not self._calls:
                    self._committer = None
                    self._cond.notify_all()
                    return
                call = self._calls[0]
            error = None
            if self._error is None:
                try:
                    self._commit(call)
                except BaseException as err:  # surfaced by add_episodes / wait / close
                    error = LeRobotWriteError(
                        f"{self._root}: {call.describe()} were not written: {err}"
                    )
                    error.__cause__ = err
            else:
                _discard_encodes(call)
            with self._cond:
                self._calls.popleft()
                self._pending_bytes -= call.nbytes
                if error is not None:
                    self._error = error
                self._cond.notify_all()

    def _commit(self, call: _Call) -> None:
        """Write one call's files under hidden names, then publish them; info.json last."""
        columns, lengths, tasks = call.columns, call.lengths, call.tasks
        first_episode, first_frame = call.first_episode, call.first_frame
        staged_videos: list[files.Staged] = []
        try:
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
                np.arange(first_episode, first_episode + len(lengths), dtype=np.int64),
                lengths_np,
            )
            columns["index"] = np.arange(first_frame, first_frame + num_frames, dtype=np.int64)
            columns["task_index"] = np.repeat(
                np.array([task_index[t] for t in tasks], dtype=np.int64), lengths_np
            )
            episode_nbytes = lengths_np * self._frame_nbytes
            arrays = []
            for name in self._schema.names:
                if name in self._image_keys:
                    pngs = call.encodes[name].result()
                    sizes = np.fromiter(map(len, pngs), dtype=np.int64, count=len(pngs))
                    episode_nbytes = episode_nbytes + np.add.reduceat(sizes, starts)
                    arrays.append(images.to_arrow(pngs))
                else:
                    arrays.append(to_arrow(columns[name]))
            table = pa.Table.from_arrays(arrays, schema=self._schema)
            info = dict(self._info)
            info["total_episodes"] = first_episode + len(lengths)
            info["total_frames"] = first_frame + num_frames
            info["total_tasks"] = len(all_tasks)
            info["splits"] = {"train": f"0:{info['total_episodes']}"}
        except Exception:
            _discard_encodes(call)
            raise

        data: list[files.Staged] = []
        metadata: list[files.Staged] = []
        other: list[files.Staged] = []  # tasks, statistics, info.json
        try:
            # The statistics update (numpy, mostly without the GIL) runs beside the parquet
            # writes (C++, without the GIL): on two cores that hides most of its cost.
            result: dict[str, Any] = {}
            worker = threading.Thread(
                target=self._merge_stats, args=(call, num_frames, result), daemon=True
            )
            worker.start()
            try:
                data_loc, data_nbytes, episode_locs = self._stage_data(
                    data, table, lengths_np, episode_nbytes
                )
                video_locs, video_frames, video_columns = self._stage_videos(staged_videos, call)
                if "next.success" in call.columns:  # per episode: did it succeed at all
                    flags = np.asarray(call.columns["next.success"]).reshape(num_frames, -1)
                    starts = np.cumsum(lengths_np) - lengths_np
                    per_episode = np.logical_or.reduceat(flags.any(axis=1), starts)
                    video_columns = {**video_columns, "success": pa.array(per_episode)}
                meta_loc, meta_table, meta_nbytes = self._stage_metadata(
                    metadata,
                    tasks,
                    lengths_np,
                    episode_locs,
                    first_episode,
                    first_frame,
                    video_columns,
                )
                if len(all_tasks) > len(self._tasks):
                    path = self._root / TASKS_PATH
                    other.append(files.stage_table(path, tasks_table(all_tasks)))
            finally:
                worker.join()
            if "error" in result:
                raise result["error"]
            other += stats.stage_files(
                self._root,
                result["stats"],
                info["total_frames"],
                result["json"],
                keep_previous=bool(self._video_keys),
            )
            other.append(files.stage_json(self._root / INFO_PATH, info))
            # Renames only from here on: data files and videos (which no committed row names
            # yet), then tasks and statistics; the episodes metadata, the rows LeRobot indexes,
            # goes right before info.json, which commits the call.
            files.publish([*data, *staged_videos, *other[:-1], *metadata, other[-1]])
        except Exception:
            files.discard([*data, *staged_videos, *metadata, *other])
            _discard_encodes(call)
            raise

        # Committed: only now does the in-memory state move, so a failed call can be retried.
        self._info = info
        self._tasks, self._task_index = all_tasks, task_index
        self._data_loc, self._data_nbytes = data_loc, data_nbytes
        self._meta_loc, self._meta_table, self._meta_nbytes = meta_loc, meta_table, meta_nbytes
        self._stats = result["stats"]
        self._video_locs.update(video_locs)
        self._video_frames.update(video_frames)

    def _merge_stats(self, call: _Call, num_frames: int, result: dict[str, Any]) -> None:
        """Thread body: the statistics with the call's frames added, and their stats.json."""
        try:
            merged = {}
            for name in self._features:
                if name in call.cameras:
                    camera = self._stats[name]
                    for frames in call.cameras[name]:
                        camera = camera.merged_episode(frames)
                    merged[name] = camera
                else:
                    values = call.columns[name].reshape(num_frames, -1)
                    merged[name] = self._stats[name].merged(values)
            result["json"] = {name: s.to_json() for name, s in merged.items()}
            result["stats"] = merged
        except BaseException as err:  # re-raised by the caller's thread
            result["error"] = err

    def _stage_videos(
        self, staged: list[files.Staged], call: _Call
    ) -> tuple[dict[str, Location], dict[str, int], dict[str, pa.Array]]:
        """Place the call's encoded video files: the first joins each camera's current file.

        The call's first file is appended to the camera's current one (remuxed together into a
        new hidden file, renamed over it at the commit) unless the two would pass
        ``video_files_size_in_mb``; the call's other files, and a first file that does not fit,
        follow as new files.

        Returns:
            Each camera's last file location and its frames, and the episodes-metadata video
            columns.
        """
        locs: dict[str, Location] = {}
        frames_in_last: dict[str, int] = {}
        columns: dict[str, pa.Array] = {}
        fps = self._info["fps"]
        limit = self._video_limit()
        for key in self._video_keys:
            paths, placed = call.encodes[key].result()
            loc = self._video_locs.get(key)
            offsets = [0] * len(paths)
            part_locs: list[Location] = []
            frames = [0] * len(paths)
            for p in placed:
                frames[p.part] = max(frames[p.part], p.start + p.length)
            for i, tmp in enumerate(paths):
                current = video_path(self._root, key, loc) if loc is not None else None
                if (
                    i == 0
                    and current is not None
                    and current.stat().st_size + tmp.stat().st_size <= limit
                ):
                    keep = self._video_frames[key]
                    out = files.tmp_path(current)
                    staged.append((out, current))  # discarded if the remux fails
                    video.append(
                        current,
                        keep,
                        tmp,
                        out,
                        fps,
                        f"{call.describe()}, appending to {current.relative_to(self._root)}",
                        encoder=self._encoder,
                        retries=self._encode_retries,
                        cancelled=lambda: self._error is not None,
                    )
                    tmp.unlink()
                    offsets[0] = keep
                    frames[0] += keep
                else:
                    loc = next_location(loc, self._info["chunks_size"])
                    staged.append((tmp, video_path(self._root, key, loc)))
                part_locs.append(loc)
            locs[key] = loc
            frames_in_last[key] = frames[-1]
            prefix = f"videos/{key}/"
            columns[prefix + "chunk_index"] = pa.array(
                [part_locs[p.part][0] for p in placed], type=pa.int64()
            )
            columns[prefix + "file_index"] = pa.array(
                [part_locs[p.part][1] for p in placed], type=pa.int64()
            )
            columns[prefix + "from_timestamp"] = pa.array(
                [(offsets[p.part] + p.start) / fps for p in placed], type=pa.float64()
            )
            columns[prefix + "to_timestamp"] = pa.array(
                [(offsets[p.part] + p.start + p.length) / fps for p in placed], type=pa.float64()
            )
        for path in {tmp.parent for tmp, path in staged} | {p.parent for _, p in staged}:
            path.mkdir(parents=True, exist_ok=True)
        return locs, frames_in_last, columns

    def _video_limit(self) -> float:
        size = self._info.get("video_files_size_in_mb") or DEFAULT_VIDEO_FILES_SIZE_IN_MB
        return float(size) * (1 << 20)

    def _file_nbytes(self, loc: Location | None) -> int:
        """A committed data file's size as the limit counts it: what its episodes added."""
        if loc is None:
            return 0
        path = data_path(self._root, loc)
        rows = pq.ParquetFile(path).metadata.num_rows
        nbytes = rows * self._frame_nbytes
        if self._image_keys:
            table = pq.read_table(path, columns=self._image_keys)
            for name in self._image_keys:
                column = table.column(name).combine_chunks().field("bytes")
                nbytes += int(pa.compute.sum(pa.compute.binary_length(column)).as_py() or 0)
        return int(nbytes)

    def _current_data(self) -> pa.Table | None:
        """The current data file's rows, to append to; None when it is full or not ours."""
        limit = float(self._info["data_files_size_in_mb"]) * (1 << 20)
        if self._data_loc is None or self._data_nbytes >= limit:
            return None
        table = pq.read_table(data_path(self._root, self._data_loc))
        if not table.schema.equals(self._schema, check_metadata=False):
            return None  # written by another tool (LeRobot): new rows go to a new file
        return table.replace_schema_metadata(self._schema.metadata)

    def _stage_data(
        self,
        staged: list[files.Staged],
        table: pa.Table,
        lengths_np: np.ndarray,
        episode_nbytes: np.ndarray,
    ) -> tuple[Location, int, list[Location]]:
        """Stage the call's data files: greedy, whole episodes, a new file before the limit.

        The first episodes join the current data file while it stays within the limit: that
        file is staged again with its rows and theirs.

        Args:
            staged: Receives each staged file as it is written.
            table: The call's frames, every column.
            lengths_np: ``[E]`` the call's episode lengths.
            episode_nbytes: ``[E]`` their uncommitted column bytes.

        Returns:
            The last data file's location and its size as the limit counts it, and each
            episode's location.
        """
        limit = float(self._info["data_files_size_in_mb"]) * (1 << 20)
        ends = np.cumsum(lengths_np)
        starts = ends - lengths_np
        current = self._current_data()
        # Groups of consecutive episodes, one per file: (appends to the current file, first
        # episode, end episode, size).
        groups: list[list] = []
        group = [current is not None, 0, 0, self._data_nbytes if current is not None else 0]
        for i, nbytes in enumerate(episode_nbytes.tolist()):
            if (group[0] or group[2] > group[1]) and group[3] + nbytes > limit:
                groups.append(group)
                group = [False, i, i, 0]
            group[2] = i + 1
            group[3] += nbytes
        groups.append(group)
        data_loc = self._data_loc
        data_nbytes = self._data_nbytes
        episode_locs: list[Location] = []
        for appends, first, end, nbytes in groups:
            if end == first:
                continue  # the current file takes none of them: it stays as it is
            if not appends:
                data_loc = next_location(data_loc, self._info["chunks_size"])
            episode_locs += [data_loc] * (end - first)
            part = table.slice(int(starts[first]), int(ends[end - 1] - starts[first]))
            if appends:
                part = pa.concat_tables([current, part])
            staged.append(
                files.stage_table(
                    data_path(self._root, data_loc),
                    part,
                    compression="snappy",
                    use_dictionary=DICTIONARY_COLUMNS,
                )
            )
            data_nbytes = int(nbytes)
        return data_loc, data_nbytes, episode_locs

    def _stage_metadata(
        self,
        staged: list[files.Staged],
        tasks: Sequence[str],
        lengths_np: np.ndarray,
        episode_locs: list[Location],
        first_episode: int,
        first_frame: int,
        video_columns: Mapping[str, pa.Array],
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
        video_row_nbytes = 32 * len(video_columns) // 4
        for i, task in enumerate(tasks):
            row_nbytes = _META_ROW_NBYTES + video_row_nbytes + len(task.encode())
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
            **video_columns,
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


def _discard_encodes(call: _Call) -> None:
    """Remove the temporary files of a call that will not be committed (waits for encodes)."""
    for future in call.encodes.values():
        if future.cancel():
            continue
        try:
            result = future.result()
        except BaseException:
            continue
        if isinstance(result, tuple):
            for path in result[0]:
                path.unlink(missing_ok=True)
