"""Camera frames to mp4 with PyAV, as LeRobot records them, and back.

Encoder settings default to LeRobot's (``VideoEncoderConfig`` in LeRobot 0.6.1): ``libsvtav1``,
``yuv420p``, a keyframe every 2 frames (``g=2``), ``crf=30``, SVT-AV1 preset 12 and
``fast-decode=0``; ``h264`` (libx264) is the other choice. Frame ``k`` of a file has
``pts = k`` in a ``1/fps`` time base, so an episode that starts at frame ``s`` of its file has
``from_timestamp = s / fps``: LeRobot decodes the frame at ``from_timestamp + timestamp``.

Several episodes go into one file, one after another; a file is closed once its size passes the
cap (checked between episodes, as LeRobot does; the frames the encoder still holds are counted
at the mean size of those it has written), and the next episode starts a new file. An episode is
never split across files.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

CODECS = ("libsvtav1", "h264")
# What LeRobot stores as ``video.codec`` (the stream's canonical name), and back.
_CANONICAL = {"libsvtav1": "av1", "h264": "h264"}
_ENCODER = {"av1": "libsvtav1", "libsvtav1": "libsvtav1", "h264": "h264"}
SVTAV1_DEFAULT_PRESET = 12


@dataclass(frozen=True)
class VideoSettings:
    """How camera features are encoded; the defaults are LeRobot's.

    Attributes:
        codec: ``"libsvtav1"`` (AV1, LeRobot's default) or ``"h264"`` (libx264).
        crf: Constant rate factor; lower is better quality and larger files.
        g: GOP size, the keyframe interval in frames (LeRobot seeks to keyframes).
        preset: Speed/quality preset; None is 12 for libsvtav1 and libx264's own default.
        pix_fmt: The stream's pixel format.
        fast_decode: SVT-AV1 fast-decode tuning (0 disables it), h264 ``tune=fastdecode``.
        threads: Threads of one encoder (SVT-AV1 ``lp``, libx264 ``threads``); None lets the
            codec decide (LeRobot's ``encoder_threads``). Not recorded in ``info``.
    """

    codec: str = "libsvtav1"
    crf: int = 30
    g: int = 2
    preset: int | str | None = None
    pix_fmt: str = "yuv420p"
    fast_decode: int = 0
    threads: int | None = None

    def __post_init__(self):
        if self.codec not in CODECS:
            raise ValueError(f"video codec must be one of {CODECS}, got {self.codec!r}")
        if self.pix_fmt != "yuv420p":
            raise ValueError(f"only pix_fmt 'yuv420p' is supported, got {self.pix_fmt!r}")
        for name in ("crf", "g", "fast_decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"video {name} must be an int >= 0, got {value!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(
                f"encoder threads must be a positive int or None, got {self.threads!r}"
            )
        if self.g < 1:
            raise ValueError(f"video g must be >= 1, got {self.g!r}")
        if self.preset is None and self.codec == "libsvtav1":
            object.__setattr__(self, "preset", SVTAV1_DEFAULT_PRESET)

    def options(self) -> dict[str, str]:
        """The codec options PyAV passes to the encoder (as LeRobot's ``get_codec_options``)."""
        opts = {"g": str(self.g), "crf": str(self.crf)}
        if self.preset is not None:
            opts["preset"] = str(self.preset)
        if self.codec == "libsvtav1":
            params = f"fast-decode={max(0, min(2, self.fast_decode))}"
            opts["svtav1-params"] = params + (f":lp={self.threads}" if self.threads else "")
        else:
            if self.fast_decode:
                opts["tune"] = "fastdecode"
            if self.threads:
                opts["threads"] = str(self.threads)
        return opts

    def info(self, shape: Sequence[int], fps: int) -> dict[str, Any]:
        """A video feature's ``info`` block, with the keys LeRobot's ``get_video_info`` writes."""
        return {
            "video.height": int(shape[0]),
            "video.width": int(shape[1]),
            "video.codec": _CANONICAL[self.codec],
            "video.pix_fmt": self.pix_fmt,
            "video.fps": int(fps),
            "video.channels": int(shape[2]),
            "has_audio": False,
            "video.g": self.g,
            "video.crf": self.crf,
            "video.preset": self.preset,
            "video.fast_decode": self.fast_decode,
            "video.video_backend": "pyav",
            "video.extra_options": {},
            "is_depth_map": False,
        }

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> VideoSettings:
        """The settings a video feature's ``info`` block records."""
        codec = info.get("video.codec")
        if codec not in _ENCODER:
            raise ValueError(f"video codec {codec!r} is not one this writer encodes ({CODECS})")
        kwargs = {"codec": _ENCODER[codec]}
        for key in ("crf", "g", "preset", "pix_fmt", "fast_decode"):
            if info.get(f"video.{key}") is not None:
                kwargs[key] = info[f"video.{key}"]
        return cls(**kwargs)


@dataclass(frozen=True)
class Placed:
    """Where an episode's frames went: file part ``part``, from ``start`` for ``length``."""

    part: int
    start: int
    length: int


def encode(
    part_path: Callable[[int], Path],
    episodes: Sequence[np.ndarray],
    fps: int,
    settings: VideoSettings,
    max_bytes: float,
    first_episode: int = 0,
) -> tuple[list[Path], list[Placed]]:
    """Encode episodes ``[L, H, W, 3]`` uint8 one after another into mp4 files.

    Args:
        part_path: The path to write file part ``i`` to (a temporary name: its suffix is not
            ``.mp4``, so the container format is given explicitly).
        episodes: Each episode's frames.
        fps: Frames per second.
        settings: The encoder settings.
        max_bytes: A file is closed after the episode that takes it past this size.
        first_episode: The first episode's index, for error messages.

    Returns:
        The files written, and per episode where its frames are.

    Raises:
        RuntimeError: naming the episode being encoded when the encoder failed.
    """
    import av

    # SVT-AV1 prints its configuration to stderr for every stream; errors only, unless the
    # user chose a level.
    os.environ.setdefault("SVT_LOG", "1")
    with _ONE_ENCODER:
        return _encode(av, part_path, episodes, fps, settings, max_bytes, first_episode)


# Encoders run one at a time in a process: in stress runs with two SVT-AV1 encoders at once
# (PyAV 18.1, 224x224) an encode intermittently hung or had a packet refused by the muxer
# (EINVAL). One SVT-AV1 stream already spreads over the cores; the pool still overlaps
# encoding with PNGs, parquet and statistics, and with collection.
_ONE_ENCODER = threading.Lock()


def _encode(av, part_path, episodes, fps, settings, max_bytes, first_episode):
    paths: list[Path] = []
    placed: list[Placed] = []
    container = stream = None
    count = written = packets = 0
    height, width = episodes[0].shape[1:3]

    def close():
        for packet in stream.encode():
            container.mux(packet)
        container.close()

    try:
        for i, frames in enumerate(episodes):
            # The encoder holds back a few frames (its lookahead): count them at the mean
            # size of those already out.
            held = count - packets
            if container is not None and written + held * written / max(packets, 1) >= max_bytes:
                close()
                container = None
            if container is None:
                paths.append(part_path(len(paths)))
                container = av.open(str(paths[-1]), "w", format="mp4")
                stream = container.add_stream(settings.codec, fps, options=settings.options())
                stream.pix_fmt = settings.pix_fmt
                stream.width, stream.height = int(width), int(height)
                stream.time_base = Fraction(1, fps)
                count = written = packets = 0
            placed.append(Placed(len(paths) - 1, count, len(frames)))
            try:
                for frame in frames:
                    vf = av.VideoFrame.from_ndarray(frame, format="rgb24")
                    vf.pts = count
                    count += 1
                    for packet in stream.encode(vf):
                        written += packet.size
                        packets += 1
                        container.mux(packet)
            except Exception as err:
                raise RuntimeError(f"episode {first_episode + i}: encoding failed: {err}") from err
        if container is not None:
            try:
                close()
            except Exception as err:
                last = first_episode + len(episodes) - 1
                raise RuntimeError(f"episode {last}: encoding failed: {err}") from err
    except BaseException:
        if container is not None:
            try:
                container.close()
            except Exception:
                pass
        for path in paths:
            path.unlink(missing_ok=True)
        raise
    return paths, placed


def num_frames(path: Path) -> int:
    """Frames in an mp4 file, from its stream header (0 if it has no readable video stream)."""
    import av

    with av.open(str(path)) as container:
        streams = container.streams.video
        return int(streams[0].frames) if streams else 0


def decode(path: Path) -> np.ndarray:
    """Every frame of an mp4 file, ``[n, H, W, 3]`` uint8 RGB."""
    import av

    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return np.stack(frames)
