"""Running statistics of every feature, as ``meta/stats.json`` reports them.

``count``, ``min``, ``max``, ``mean`` and ``std`` (population, as LeRobot's) are exact running
aggregates (float64, Chan's parallel update). Quantiles come from a histogram per feature
dimension whose buckets are float32 bit patterns cut to sign, exponent and the top 6 mantissa
bits: a bucket spans 1/64 of a binary octave, so a reported quantile is within 2**-7 (0.8%)
relative of a value between the order statistics that bracket it, clipped to the exact
``[min, max]``. The histogram is a plain count per bucket, so it is deterministic and independent
of how frames were split into calls.

Cameras (``CameraStats``) are summarised as LeRobot's ``compute_episode_stats`` does: per
episode a subsample of frames (all of them up to 100, then ``L**0.75`` evenly spaced, at most
10,000), downsampled to about 150 pixels a side when a side reaches 300, and statistics per
channel over every sampled pixel, scaled to [0, 1], of shape ``[3, 1, 1]``; ``count`` is the
number of sampled frames. The episodes merge exactly (a 256-bin histogram per channel), so
``mean``/``std``/``min``/``max`` are those of all sampled pixels (LeRobot's count-weighted
merge gives the same), and quantiles are exact over them (LeRobot averages per-episode ones).

The state is cached in ``meta/.jaxtraj-stats.npz`` (sparse) so that reopening a dataset does not
rescan its data; ``load_state`` returns None when the cache is missing, damaged or stale, and
``rebuild`` recomputes the statistics from the data files.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from jaxtraj.lerobot import files
from jaxtraj.lerobot.format import STATS_PATH, STATS_PREVIOUS_PATH, STATS_STATE_PATH, to_numpy
from jaxtraj.lerobot.images import decode_png

QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}

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


class RunningStats:
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

    def merged(self, values: np.ndarray) -> RunningStats:
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

        out = RunningStats(width)
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


def sample_indices(length: int) -> np.ndarray:
    """The frames of an episode that camera statistics read (LeRobot's subsampling rule)."""
    num = length if length < 100 else max(100, min(int(length**0.75), 10_000))
    return np.round(np.linspace(0, length - 1, num)).astype(np.int64)


def downsample(frames: np.ndarray) -> np.ndarray:
    """``[n, H, W, C]`` frames strided to about 150 pixels a side once a side reaches 300."""
    height, width = frames.shape[1:3]
    if max(height, width) < 300:
        return frames
    step = int(width / 150) if width > height else int(height / 150)
    return frames[:, ::step, ::step]


class CameraStats:
    """Per-channel pixel histogram of a camera's sampled frames (uint8: 256 exact bins).

    Attributes:
        channels: C.
        frames: Sampled frames so far (LeRobot's ``count``).
        hist: ``[C, 256]`` int64 pixel counts.
    """

    def __init__(self, channels: int):
        self.channels = channels
        self.frames = 0
        self.hist = np.zeros((channels, 256), dtype=np.int64)

    @property
    def count(self) -> int:
        return self.frames

    def merged_episode(self, frames: np.ndarray) -> CameraStats:
        """These statistics plus one episode's frames ``[L, H, W, C]`` uint8, subsampled."""
        sampled = downsample(frames[sample_indices(len(frames))])
        out = CameraStats(self.channels)
        out.frames = self.frames + len(sampled)
        out.hist = self.hist.copy()
        for c in range(self.channels):
            out.hist[c] += np.bincount(sampled[..., c].reshape(-1), minlength=256)
        return out

    def merged_stats(self, other: CameraStats) -> CameraStats:
        out = CameraStats(self.channels)
        out.frames = self.frames + other.frames
        out.hist = self.hist + other.hist
        return out

    def to_json(self) -> dict[str, Any]:
        """The feature's ``meta/stats.json`` entry: ``[C, 1, 1]`` lists in [0, 1]."""
        values = np.arange(256, dtype=np.float64) / 255.0
        total = self.hist.sum(1)
        n = np.maximum(total, 1)
        mean = self.hist @ values / n
        var = np.maximum(self.hist @ (values * values) / n - mean * mean, 0.0)
        seen = self.hist > 0
        lo = np.array([values[np.flatnonzero(r)[0]] if r.any() else 0.0 for r in seen])
        hi = np.array([values[np.flatnonzero(r)[-1]] if r.any() else 0.0 for r in seen])
        stats: dict[str, Any] = {"min": lo, "max": hi, "mean": mean, "std": np.sqrt(var)}
        cumulative = np.cumsum(self.hist, 1)
        for key, q in QUANTILES.items():
            rank = q * (total - 1)
            ends = [
                values[[np.searchsorted(cum, r, side="right") for cum, r in zip(cumulative, o)]]
                for o in (np.floor(rank), np.ceil(rank))
            ]
            stats[key] = ends[0] + (rank - np.floor(rank)) * (ends[1] - ends[0])
        out = {k: v.reshape(-1, 1, 1).tolist() for k, v in stats.items()}
        out["count"] = [int(self.frames)]
        return out


Stats = RunningStats | CameraStats


def pack_stats(stats: Mapping[str, Stats], num_frames: int) -> dict[str, np.ndarray]:
    """Every feature's running statistics as a few flat arrays, for ``meta/.jaxtraj-stats.npz``."""
    cameras = {k: v for k, v in stats.items() if isinstance(v, CameraStats)}
    stats = {k: v for k, v in stats.items() if not isinstance(v, CameraStats)}
    values = list(stats.values())
    return {
        "camera_names": np.array(list(cameras), dtype=str),
        "camera_frames": np.array([c.frames for c in cameras.values()], dtype=np.int64),
        "camera_hist": np.stack([c.hist for c in cameras.values()])
        if cameras
        else np.zeros((0, 3, 256), np.int64),
        "num_frames": np.array(num_frames, dtype=np.int64),
        "names": np.array(list(stats)),
        "count": np.array([s.count for s in values], dtype=np.int64),
        "moments": np.concatenate([np.stack([s.mean, s.m2, s.min, s.max]) for s in values], 1),
        "num_keys": np.array([len(s.keys) for s in values], dtype=np.int64),
        "keys": np.concatenate([s.keys for s in values]),
        "counts": np.concatenate([s.counts for s in values]),
    }


def unpack_stats(
    state: Mapping[str, np.ndarray], features: Mapping[str, Mapping[str, Any]]
) -> dict[str, RunningStats]:
    """Inverse of ``pack_stats``; raises ValueError if it does not fit ``features``."""
    cameras = {k: v for k, v in features.items() if v["dtype"] in ("video", "image")}
    features = {k: v for k, v in features.items() if k not in cameras}
    if list(state["names"]) != list(features):
        raise ValueError("stats state lists other features")
    if list(state["camera_names"]) != list(cameras):
        raise ValueError("stats state lists other cameras")
    camera_stats = {}
    for name, frames, hist in zip(cameras, state["camera_frames"], state["camera_hist"]):
        camera_stats[name] = CameraStats(cameras[name]["shape"][2])
        camera_stats[name].frames = int(frames)
        camera_stats[name].hist = np.asarray(hist, dtype=np.int64)
        if hist.shape != (cameras[name]["shape"][2], 256) or frames < 0:
            raise ValueError(f"stats state of {name!r} is inconsistent")
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
        stats = RunningStats(width)
        stats.count = int(count)
        stats.mean, stats.m2, stats.min, stats.max = (row.copy() for row in moment)
        stats.keys, stats.counts = keys.astype(np.int64), counts.astype(np.int64)
        if moment.shape != (4, width) or int(stats.counts.sum()) != stats.count * width:
            raise ValueError(f"stats state of {name!r} is inconsistent")
        out[name] = stats
    return {**out, **camera_stats}


def empty(features: Mapping[str, Mapping[str, Any]]) -> dict[str, Stats]:
    """No frames seen yet, for every feature."""
    return {
        name: CameraStats(spec["shape"][2])
        if spec["dtype"] in ("video", "image")
        else RunningStats(spec["shape"][0])
        for name, spec in features.items()
    }


def load_state(
    path: Path, features: Mapping[str, Mapping[str, Any]], num_frames: int
) -> dict[str, RunningStats] | None:
    """The cached statistics, or None if the cache is missing, damaged or not of ``num_frames``.

    The cache is only ever a shortcut: a truncated or garbled file (a zip that does not open, a
    member that does not read, arrays that do not fit ``features``) reads as no cache at all.
    """
    if not path.is_file():
        return None
    try:
        # Opened here: np.load(path) leaks its file handle when the zip does not open.
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as state:
            if int(state["num_frames"]) != num_frames:
                return None
            return unpack_stats(state, features)
    except (OSError, EOFError, KeyError, ValueError, TypeError, zipfile.BadZipFile):
        return None


def save_state(path: Path, stats: Mapping[str, RunningStats], num_frames: int) -> None:
    """Write the cache to ``path`` (``np.savez``, which would append ``.npz`` to a bare name)."""
    with open(path, "wb") as f:
        np.savez(f, **pack_stats(stats, num_frames))


def rebuild(
    paths: Sequence[Path],
    features: Mapping[str, Mapping[str, Any]],
    video_episodes: Callable[[str], Iterable[np.ndarray]] | None = None,
) -> dict[str, Stats]:
    """The statistics of every frame in the data files ``paths``, read one file at a time.

    Image features are decoded from their PNGs, episode by episode; video features come from
    ``video_episodes(name)``, every committed episode's decoded frames in order. Camera
    statistics rebuilt from stored frames are those of the decoded (lossy) video, close to
    but not exactly those of the frames the writer received.
    """
    stats = empty(features)
    columns = [k for k, v in features.items() if v["dtype"] != "video"]
    images = [k for k in columns if features[k]["dtype"] == "image"]
    for path in paths:
        try:
            extra = ["episode_index"] if images and "episode_index" not in columns else []
            table = pq.read_table(path, columns=columns + extra)
        except (OSError, ValueError) as err:  # pyarrow's errors derive from these
            raise ValueError(f"{path}: unreadable data file ({err})") from None
        for name in columns:
            if name in images:
                continue
            values = to_numpy(table.column(name), features[name]["shape"][0])
            if len(values):
                stats[name] = stats[name].merged(values)
        if images:
            episode = table.column("episode_index").to_numpy()
            bounds = np.flatnonzero(np.diff(episode)) + 1
            for name in images:
                pngs = table.column(name).combine_chunks().field("bytes").to_pylist()
                for part in np.split(np.arange(len(pngs)), bounds):
                    if len(part):
                        frames = np.stack([decode_png(pngs[i]) for i in part])
                        stats[name] = stats[name].merged_episode(frames)
    for name, spec in features.items():
        if spec["dtype"] == "video" and video_episodes is not None:
            for frames in video_episodes(name):
                stats[name] = stats[name].merged_episode(frames)
    return stats


def stage_files(
    root: Path,
    running: Mapping[str, Stats],
    num_frames: int,
    stats_json: Mapping[str, Any] | None = None,
    keep_previous: bool = False,
) -> list[files.Staged]:
    """Stage ``meta/stats.json`` and the cache for ``num_frames`` frames; publish nothing.

    ``stats_json`` is ``meta/stats.json``'s content when already computed. With
    ``keep_previous`` the cache in place is first renamed to ``STATS_PREVIOUS_PATH``, so that a
    writer killed before ``info.json`` commits still finds the committed statistics: camera
    statistics rebuilt from lossy videos would not be the same.
    """
    if stats_json is None:
        stats_json = {name: s.to_json() for name, s in running.items()}
    staged = [
        # Compact: json's indenting encoder is pure Python, ten times slower than the C one.
        files.stage_json(root / STATS_PATH, stats_json, indent=None),
    ]
    current = root / STATS_STATE_PATH
    if keep_previous and current.is_file():
        staged.append((current, root / STATS_PREVIOUS_PATH))
    staged.append(files.stage(current, lambda tmp: save_state(tmp, running, num_frames)))
    return staged
