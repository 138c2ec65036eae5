"""Checking the episodes handed to ``LeRobotWriter.add_episodes`` before anything is written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def check_episodes(
    features: Mapping[str, Mapping[str, Any]],
    episodes: Sequence[Mapping[str, Any]],
    tasks: Sequence[str],
) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]], list[int]]:
    """Check every episode and task against the declared ``features``.

    Arrays are converted with numpy's ``same_kind`` casting (float64 -> float32 and int -> float
    are fine; float -> int, anything -> bool and out-of-range integers are not); float values
    must be finite. A feature of shape ``[1]`` takes ``[L]`` or ``[L, 1]``, one of shape ``[D]``
    takes ``[L, D]``, a camera of shape ``[H, W, 3]`` takes ``[L, H, W, 3]`` uint8 (no
    conversion), with one ``L >= 1`` per episode.

    Args:
        features: The user's features (without LeRobot's bookkeeping columns).
        episodes: One dict per episode, feature name -> array.
        tasks: One non-empty task string per episode.

    Returns:
        ``(columns, cameras, lengths)``: per vector feature the episodes' frames concatenated
        and cast, ``[sum(lengths)]`` or ``[sum(lengths), D]``; per camera feature each
        episode's frames, copied (the writer may encode them after the call returns); and each
        episode's length.

    Raises:
        ValueError: naming the first episode and feature that does not fit.
    """
    if isinstance(episodes, Mapping) or not isinstance(episodes, Sequence):
        raise ValueError("episodes must be a list of dicts, one per episode")
    if isinstance(tasks, str) or not isinstance(tasks, Sequence):
        raise ValueError("tasks must be a list of strings, one per episode")
    if len(tasks) != len(episodes):
        raise ValueError(f"got {len(episodes)} episodes but {len(tasks)} tasks")
    user = {k: v for k, v in features.items() if v["dtype"] not in ("video", "image")}
    cams = {k: v for k, v in features.items() if v["dtype"] in ("video", "image")}
    parts: dict[str, list[np.ndarray]] = {name: [] for name in user}
    cameras: dict[str, list[np.ndarray]] = {name: [] for name in cams}
    lengths: list[int] = []
    for i, (episode, task) in enumerate(zip(episodes, tasks)):
        if not isinstance(task, str) or not task.strip():
            raise ValueError(f"episode {i}: task must be a non-empty string, got {task!r}")
        if not isinstance(episode, Mapping):
            raise ValueError(f"episode {i}: expected a dict of arrays, got {type(episode)}")
        missing = sorted(set(features) - set(episode))
        extra = sorted(set(episode) - set(features))
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
                    f"episode {i}: feature {name!r} has shape {list(array.shape)}, expected {want}"
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
        for name, spec in cams.items():
            array = np.asarray(episode[name])
            want = (length if length is not None else array.shape[0], *spec["shape"])
            if array.ndim != 4 or array.shape != want or array.dtype != np.uint8:
                raise ValueError(
                    f"episode {i}: camera {name!r} has {array.dtype} {list(array.shape)},"
                    f" expected uint8 {list(want)}"
                )
            if length is None:
                length = array.shape[0]
                if length == 0:
                    raise ValueError(f"episode {i}: has no frames")
            cameras[name].append(np.array(array, order="C", copy=True))
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
    return columns, cameras, lengths
